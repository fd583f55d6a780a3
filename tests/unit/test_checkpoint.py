"""Checkpoints are atomic: a writer SIGKILLed mid-write leaves the previous one loadable, and a
corrupt or partial checkpoint is skipped by its checksum."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import checkpoint

REPO = Path(__file__).resolve().parents[2]

# Saves ever larger checkpoints in a loop until killed; each holds its step in every element.
_WRITER = """
import sys, torch
from harness import checkpoint
d = sys.argv[1]
step = 1
while True:
    checkpoint.save(d, step, {"step": step, "x": torch.full((8_000_000,), float(step))}, keep=2)
    step += 1
"""


def _state(step: int) -> dict[str, object]:
    return {"step": step, "x": torch.full((10,), float(step))}


def test_save_load_and_keep_newest(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path / "none") is None
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, _state(step), keep=2)
    step, state = checkpoint.load_latest(tmp_path)
    assert step == 30 and torch.equal(state["x"], _state(30)["x"])
    assert sorted(p.name for p in tmp_path.glob("step_*.json")) == [
        "step_00000020.json",
        "step_00000030.json",
    ]
    assert not (tmp_path / "step_00000010.pt").exists()


def test_corrupt_and_partial_checkpoints_are_skipped(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, _state(1), keep=5)
    checkpoint.save(tmp_path, 2, _state(2), keep=5)
    checkpoint.save(tmp_path, 3, _state(3), keep=5)
    # step 3: one flipped byte in the payload; step 2: payload torn in half.
    p3 = tmp_path / "step_00000003.pt"
    data = bytearray(p3.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p3.write_bytes(bytes(data))
    p2 = tmp_path / "step_00000002.pt"
    p2.write_bytes(p2.read_bytes()[: p2.stat().st_size // 2])
    # step 4: a payload whose manifest was never written (crash between the two renames).
    (tmp_path / "step_00000004.pt").write_bytes(b"partial")
    step, state = checkpoint.load_latest(tmp_path)
    assert step == 1 and state["step"] == 1


@pytest.mark.timeout(120)
def test_sigkill_mid_write_leaves_previous_checkpoint_valid(tmp_path: Path) -> None:
    hits = 0
    for trial in range(3):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(d)], env=env)
        try:
            deadline = time.monotonic() + 60
            # Wait until a later checkpoint is being written (its temp file exists), then kill.
            while not any(
                p.name.startswith(".step_")
                for p in d.iterdir()
                if not p.name.startswith(".step_00000001")
            ):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.0005)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        hits += any(p.name.endswith(".tmp") for p in d.iterdir())
        loaded = checkpoint.load_latest(d)
        assert loaded is not None
        step, state = loaded
        assert step >= 1 and state["step"] == step
        assert bool((state["x"] == float(step)).all())
        manifest = json.loads((d / f"step_{step:08d}.json").read_text())
        assert manifest["bytes"] == (d / manifest["file"]).stat().st_size
    # The kill landed mid-write (a torn temp file was left) in at least one trial.
    assert hits >= 1
