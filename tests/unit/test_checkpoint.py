"""Checkpoints are atomic: a writer SIGKILLed mid-write leaves the previous one loadable, and a
corrupt or partial checkpoint is skipped by its checksum."""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from harness.rank import checkpoint

REPO = Path(__file__).resolve().parents[2]

# Saves ever larger checkpoints in a loop until killed; each holds its step in every element.
_WRITER = """
import sys, torch
from harness.rank import checkpoint
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


# --- trust: a checkpoint is data, confined to its folder, private to its user ---------------


class _RunsCode:
    """Unpickling this makes a directory: the stand-in for any code a planted pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def _plant(d: Path, step: int, payload: bytes, file: object = None) -> None:
    """A checkpoint written by someone else: any payload, a manifest that matches it."""
    name = f"step_{step:08d}.pt"
    (d / name).write_bytes(payload)
    manifest = {
        "step": step,
        "file": name if file is None else file,
        "bytes": len(payload),
        "xxh3_128": xxhash.xxh3_128_hexdigest(payload),
    }
    (d / f"step_{step:08d}.json").write_text(json.dumps(manifest))


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_trainer_state_loads_with_weights_only(tmp_path: Path) -> None:
    """Everything the trainer saves (model, AdamW state, data position, manager counters)
    loads back under weights_only=True, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    state = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "data": {"position": 12345},
        "manager": {"step": 7, "batches_committed": 21},
    }
    checkpoint.save(tmp_path, 7, state)
    step, loaded = checkpoint.load_latest(tmp_path)
    assert step == 7
    assert loaded["data"] == {"position": 12345}
    assert loaded["manager"] == {"step": 7, "batches_committed": 21}
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    fresh.load_state_dict(loaded["optim"])
    assert fresh.param_groups[0]["betas"] == (0.9, 0.95)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    for idx, s in state["optim"]["state"].items():
        for key, v in s.items():
            assert torch.equal(loaded["optim"]["state"][idx][key], v)


def test_a_checkpoint_that_would_run_code_is_skipped(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, _state(1))
    ran = tmp_path.parent / f"{tmp_path.name}-code-ran"
    _plant(tmp_path, 2, _torch_bytes({"step": 2, "x": _RunsCode(ran)}))
    step, state = checkpoint.load_latest(tmp_path)
    assert not ran.exists()
    assert step == 1 and state["step"] == 1


def test_a_manifest_cannot_point_outside_its_folder(tmp_path: Path) -> None:
    d, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    outside.mkdir()
    checkpoint.save(d, 1, _state(1))
    foreign = _torch_bytes(_state(99))
    (outside / "w.pt").write_bytes(foreign)
    _plant(d, 2, foreign, file="../elsewhere/w.pt")
    _plant(d, 3, foreign, file=str(outside / "w.pt"))
    _plant(d, 4, foreign)
    (d / "step_00000004.pt").unlink()
    (d / "step_00000004.pt").symlink_to(outside / "w.pt")  # a link leading out
    step, state = checkpoint.load_latest(d)
    assert step == 1 and state["step"] == 1


@pytest.mark.parametrize(
    "manifest",
    ["[1, 2]", '"step_00000002.pt"', "null", '{"step": 2, "file": 5, "bytes": 1, "xxh3_128": ""}'],
)
def test_a_manifest_that_is_not_an_object_is_skipped(tmp_path: Path, manifest: str) -> None:
    checkpoint.save(tmp_path, 1, _state(1))
    (tmp_path / "step_00000002.pt").write_bytes(_torch_bytes(_state(2)))
    (tmp_path / "step_00000002.json").write_text(manifest)
    step, _ = checkpoint.load_latest(tmp_path)
    assert step == 1


def test_checkpoints_are_private(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    checkpoint.save(d, 1, _state(1))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("step_00000001.pt", "step_00000001.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600


# --- the split: snapshot (training thread) then write (anywhere) ----------------------------


def test_snapshot_then_write_is_what_save_writes(tmp_path: Path) -> None:
    a, b = tmp_path / "save", tmp_path / "split"
    for step in (1, 2, 3):
        checkpoint.save(a, step, _state(step), keep=2)
        path = checkpoint.write(b, step, checkpoint.snapshot(_state(step)), keep=2)
        assert path == b / f"step_{step:08d}.json"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert (b / p.name).read_bytes() == p.read_bytes()
    step, state = checkpoint.load_latest(b)
    assert step == 3 and torch.equal(state["x"], _state(3)["x"])


def test_the_snapshot_is_a_copy(tmp_path: Path) -> None:
    state = _state(1)
    payload = checkpoint.snapshot(state)
    state["x"].fill_(99.0)  # training goes on while the write is pending
    checkpoint.write(tmp_path, 1, payload)
    _, loaded = checkpoint.load_latest(tmp_path)
    assert bool((loaded["x"] == 1.0).all())


# Each syscall of a write, failing on its n-th call (ENOSPC): the payload's fsync, rename and
# directory fsync, then the manifest's fsync and rename. (A failing last directory fsync comes
# after the manifest is in place: the checkpoint is complete, only its durability unsure.)
@pytest.mark.parametrize(
    ("call", "nth"), [("fsync", 1), ("replace", 1), ("fsync", 2), ("fsync", 3), ("replace", 2)]
)
def test_a_write_failing_midway_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, nth: int
) -> None:
    checkpoint.save(tmp_path, 1, _state(1))
    payload = checkpoint.snapshot(_state(2))
    real = getattr(os, call)
    calls = 0

    def failing(*args: object) -> object:
        nonlocal calls
        calls += 1
        if calls == nth:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.write(tmp_path, 2, payload)
    monkeypatch.undo()
    step, state = checkpoint.load_latest(tmp_path)
    assert step == 1 and state["step"] == 1
    assert not list(tmp_path.glob(f".*{checkpoint._TMP_SUFFIX}"))  # no temp file left behind
    checkpoint.write(tmp_path, 2, payload)  # the disk has room again: the next write lands
    assert checkpoint.load_latest(tmp_path)[0] == 2


# --- the background writer -------------------------------------------------------------------


def test_the_writer_runs_one_write_at_a_time_in_order() -> None:
    writer = checkpoint.BackgroundWriter()
    log: list[str] = []
    release = threading.Event()
    started = threading.Event()

    def first() -> None:
        log.append("first starts")
        started.set()
        assert release.wait(60)
        log.append("first ends")

    writer.submit(first)  # returns at once: the write runs on the writer thread
    assert started.wait(60)
    assert writer.busy() and log == ["first starts"]
    second = threading.Thread(target=writer.submit, args=(lambda: log.append("second"),))
    second.start()  # waits for the first write before handing its own over
    release.set()
    second.join(60)
    writer.close()
    assert log == ["first starts", "first ends", "second"]
    assert not writer.busy()
    with pytest.raises(RuntimeError, match="after shutdown"):
        writer.submit(lambda: None)


def test_a_failed_write_is_raised_once_by_the_next_submit_or_wait() -> None:
    writer = checkpoint.BackgroundWriter()

    def enospc() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(enospc)
    with pytest.raises(OSError, match="No space left"):
        writer.submit(lambda: None)  # the next checkpoint: the failure surfaces there
    writer.wait()  # raised once; the write after it went through
    writer.submit(enospc)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()  # the end of training: surfaces there
    writer.close()  # nothing left to raise


def test_steps_and_load_one_step(tmp_path: Path) -> None:
    assert checkpoint.steps(tmp_path / "none") == []
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, _state(step), keep=5)
    assert checkpoint.steps(tmp_path) == [30, 20, 10]
    assert torch.equal(checkpoint.load(tmp_path, 20)["x"], _state(20)["x"])
    assert checkpoint.load(tmp_path, 25) is None
    p = tmp_path / "step_00000020.pt"
    p.write_bytes(p.read_bytes()[:-1])  # torn: listed, but does not load
    assert 20 in checkpoint.steps(tmp_path) and checkpoint.load(tmp_path, 20) is None


def _group_common_step(held: list[list[int]]) -> tuple[list[int], int]:
    """Run common_step on one thread per rank, each holding the steps ``held[rank]``, with a
    real barrier as the group's MIN; return every rank's answer and the rounds taken."""
    ranks = len(held)
    proposals = [0] * ranks
    barrier = threading.Barrier(ranks)
    rounds = [0]
    answers = [0] * ranks

    def run(rank: int) -> None:
        def newest_at_most(bound: int) -> int:
            return max((s for s in held[rank] if s <= bound), default=-1)

        def group_min(value: int) -> int:
            proposals[rank] = value
            barrier.wait()
            agreed = min(proposals)
            if rank == 0:
                rounds[0] += 1
            barrier.wait()  # nobody overwrites a proposal before every rank has read them
            return agreed

        answers[rank] = checkpoint.common_step(newest_at_most, group_min)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return answers, rounds[0]


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        ([[60, 50], [60, 50]], 60),  # the usual case
        ([[60, 50], [50, 40]], 50),  # rank 1 died writing 60
        ([[70, 60, 50], [60, 50], [70, 50]], 50),  # 70 and 60 each missing somewhere
        ([[60, 50], []], -1),  # a rank with nothing: the group starts fresh
        ([[], []], -1),
        ([[30]], 30),  # one rank
    ],
)
def test_a_group_agrees_on_the_newest_step_every_rank_has(
    held: list[list[int]], expected: int
) -> None:
    answers, rounds = _group_common_step(held)
    assert answers == [expected] * len(held)
    assert rounds <= 1 + sum(len(h) for h in held)
