"""The controller dies and a new one takes over (``harness.job.takeover``), end to end: a real
``ftharness run`` under its keeper, its controller SIGKILLed (``experiments/bench/takeover.py``
does the killing and reads the journal), and what a user sees: the run reaches its last step
with rc 0, no trainer restarted, no committed step lost, the replicas equal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from e2e_helpers import start_stranger, wait_until

from experiments.bench import takeover as bench
from runtime.journal import JOB_END, PROC_START, STEP_COMMIT, read_journal

pytestmark = pytest.mark.e2e


def _no_process_of(run_dir: Path) -> list[str]:
    """Processes still running with ``run_dir`` on their command line or in their cwd."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                left.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:120]}")
        except psutil.Error:
            continue
    return left


def test_a_controller_killed_twice_in_a_row_restarts_no_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = bench.run(2, interval=30, out=run_dir, timeout_s=240)
    assert result["rc"] == 0, result.get("output_tail")
    assert result["crashes"] == 2
    assert result["workers_restarted"] == 0  # every group adopted, twice
    assert result["steps_back"] == 0
    assert result["replicas_equal"], result
    records = read_journal(run_dir / "journal.jsonl")
    takeovers = [r for r in records if r["event"] == "controller.takeover" and "epoch" in r]
    assert [r["epoch"] for r in takeovers] == [2, 3]
    assert all(r["lost"] == [] for r in takeovers)
    assert records[-1]["event"] == JOB_END and records[-1]["status"] == "ok"
    assert max(r["step"] for r in records if r["event"] == STEP_COMMIT) == result["steps"]
    assert wait_until(lambda: not _no_process_of(run_dir), time.monotonic() + 10)


def _start(run_dir: Path, *options: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out",
            str(run_dir), "--quiet", *(f"--set={o}" for o in options)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _committed(run_dir: Path) -> int:
    return bench._committed(run_dir)


def _controller_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "controller.json").read_text())["pid"]


def test_a_controller_killed_while_a_group_heals_restarts_that_group_only(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "steps=200", "replicas=3", "checkpoint.every_steps=0")
    try:
        assert wait_until(lambda: _committed(run_dir) >= 30, time.monotonic() + 120)
        starts = [r for r in read_journal(run_dir / "journal.jsonl") if r["event"] == PROC_START]
        victim = next(r for r in starts if r.get("replica") == 1)
        t_victim = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)  # group 1 dies...
        time.sleep(0.05)  # ... its failure reaches the controller, which starts a replacement
        os.kill(_controller_pid(run_dir), signal.SIGKILL)  # ... and the controller dies
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-2000:]
    records = read_journal(run_dir / "journal.jsonl")
    assert any(r.get("cause") == "controller_crash" for r in records)
    later = [r for r in records if r["event"] == PROC_START and r["t"] >= t_victim]
    assert {r.get("replica") for r in later if r.get("replica") is not None} == {1}
    commits = [r for r in records if r["event"] == STEP_COMMIT]
    assert max(r["step"] for r in commits) == 200
    last = {r["replica"]: r.get("checksum") for r in commits if r["step"] == 200}
    assert len(last) == 3 and len(set(last.values())) == 1, last


def test_a_journal_edited_by_hand_is_refused_and_the_run_ends(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "steps=2000", "replicas=2", "checkpoint.every_steps=0")
    try:
        assert wait_until(lambda: _committed(run_dir) >= 10, time.monotonic() + 120)
        path = run_dir / "journal.jsonl"
        lines = path.read_text().splitlines(keepends=True)
        kept = [x for x in lines if '"event": "group.start"' not in x or '"replica": 0' not in x]
        os.kill(_controller_pid(run_dir), signal.SIGSTOP)  # nothing appends while we edit
        path.write_text("".join(kept))
        os.kill(_controller_pid(run_dir), signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "no new one could take over" in output and "missing from the journal" in output
    end = [r for r in read_journal(run_dir / "journal.jsonl") if r["event"] == JOB_END]
    assert end and end[-1]["status"] == "failed"
    assert wait_until(lambda: not _no_process_of(run_dir), time.monotonic() + 15)


def test_a_stopped_controller_is_killed_by_its_keeper_and_taken_over(tmp_path: Path) -> None:
    """SIGSTOP: the controller neither exits nor answers. Its keeper hears no beat for
    ``timeouts.controller_silence``, kills it, and the standby takes over; nothing restarts."""
    run_dir = tmp_path / "run"
    options = (
        "steps=600",
        "replicas=2",
        "checkpoint.every_steps=0",
        "timeouts.controller_silence=4",
    )
    proc = _start(run_dir, *options)
    try:
        assert wait_until(lambda: _committed(run_dir) >= 100, time.monotonic() + 120)
        t_stop = time.time()
        os.kill(_controller_pid(run_dir), signal.SIGSTOP)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-2000:]
    assert "has not been heard from for 4 s (stopped or hung): killing it" in output
    records = read_journal(run_dir / "journal.jsonl")
    takeovers = [r for r in records if r["event"] == "controller.takeover" and "epoch" in r]
    assert [r["epoch"] for r in takeovers] == [2]
    later = [r for r in records if r["event"] == PROC_START and r["t"] >= t_stop]
    assert not [r for r in later if r.get("replica") is not None]  # no group restarted
    assert max(r["step"] for r in records if r["event"] == STEP_COMMIT) == 600
    assert wait_until(lambda: not _no_process_of(run_dir), time.monotonic() + 10)


def test_a_stranger_on_the_dead_controllers_quorum_port_gets_nothing_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """Issue #49: the moment the controller dies its quorum port is free, and another user
    binds it. The new controller serves the quorum elsewhere (the trainers reach it through
    their host agent's relay, which forwards nowhere while no controller serves), so the
    stranger is dialled by nobody, and the run ends well with no trainer restarted."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "steps=300", "replicas=2", "checkpoint.every_steps=0")
    stranger = None
    try:
        assert wait_until(lambda: _committed(run_dir) >= 20, time.monotonic() + 120)
        saved = json.loads((run_dir / "quorum.json").read_text())
        stranger = start_stranger(saved["host"], int(saved["port"]), seconds=20)
        t_kill = time.time()
        os.kill(_controller_pid(run_dir), signal.SIGKILL)
        assert stranger.stdout is not None
        took = json.loads(stranger.stdout.readline())
        output, _ = proc.communicate(timeout=180)
        assert stranger.stdin is not None
        stranger.stdin.close()
        got = json.loads(stranger.stdout.readline())
    finally:
        for p in (proc, stranger):
            if p is not None and p.poll() is None:
                p.kill()
    assert took["bound"], "the dead controller's quorum port never came free: nothing tested"
    assert proc.returncode == 0, output[-2000:]
    assert got["accepted"] == 0 and got["bytes"] == 0, got
    records = read_journal(run_dir / "journal.jsonl")
    assert records[-1]["event"] == JOB_END and records[-1]["status"] == "ok"
    takeovers = [r for r in records if r["event"] == "controller.takeover"]
    adopted = sorted((r["replica"], r["adopted"]) for r in takeovers if "adopted" in r)
    assert adopted == [(0, True), (1, True)], takeovers  # both groups went on as they were
    assert not [r for r in records if r["event"] == PROC_START and r["t"] > t_kill]
