"""A ``[program]`` job survives its controller's SIGKILL (``harness.job.program.takeover``), end
to end: a real ``ftharness run`` of tests/programs/train_ddp.py (a plain torchft program) under
its keeper, its controller SIGKILLed mid-run and then its successor, and the run reaches its
last step with rc 0, no program restarted, no committed step lost. Two groups of two ranks: each
group's store (``MASTER_ADDR``), served by its host agent (``runtime.group_store``), still serves
what the ranks wrote in it after the controller died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import wait_until

from runtime.journal import JOB_END, PROC_START, STEP_COMMIT, read_journal

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "train_ddp.py"
STEPS = 240
REPLICAS = 2
RANKS = 2


def _config(path: Path) -> Path:
    path.write_text(
        f"""
name = "program_takeover"
replicas = {REPLICAS}
ranks = {RANKS}
hosts = 1
steps = {STEPS}
bind_host = "127.0.0.1"
recovery = {{ policy = "in_place", quorum = "tree" }}

[timeouts]
heartbeat_interval = 0.2
heartbeat_timeout = 2.0
lighthouse_join_timeout = 4.0
process_group_timeout = 4.0

[program]
kind = "torchft"
command = ["python", {json.dumps(str(PROGRAM))}, "{STEPS}", "0.05"]
progress_timeout_s = 10.0
start_timeout_s = 90.0
"""
    )
    return path


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "journal.jsonl"
    return read_journal(path) if path.exists() else []


def _committed(run_dir: Path) -> int:
    return max((int(r["step"]) for r in _records(run_dir) if r["event"] == STEP_COMMIT), default=0)


def _controller(run_dir: Path) -> dict:
    path = run_dir / "controller.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.timeout(150)
def test_a_program_job_survives_its_controllers_sigkill_twice(tmp_path: Path) -> None:
    from datetime import timedelta

    import psutil
    from torch.distributed import TCPStore

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "harness", "run", str(_config(tmp_path / "job.toml")),
            "--out", str(run_dir), "--quiet"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert wait_until(lambda: _committed(run_dir) >= 60, time.monotonic() + 90), (
            "no progress before the kill"
        )
        state = json.loads((run_dir / "program.json").read_text())
        first = _controller(run_dir)
        assert first["epoch"] == 1
        stores = [g["store"] for g in state["groups"].values()]
        assert len(stores) == REPLICAS, state
        for store in stores:  # served by a child of a host agent, not by the controller
            pid = _listener_pid(int(store.rsplit(":", 1)[1]))
            assert pid is not None and pid != int(first["pid"]), (store, pid)
            assert "runtime.agent" in " ".join(psutil.Process(pid).parent().cmdline()), store
        os.kill(int(first["pid"]), signal.SIGKILL)
        killed_at = _committed(run_dir)
        # the stores outlive it, with what the ranks wrote in them when they started
        for store in stores:
            host, port = store.rsplit(":", 1)
            client = TCPStore(
                host, int(port), is_master=False, wait_for_workers=False,
                timeout=timedelta(seconds=5),
            )  # fmt: skip
            assert client.num_keys() > 0, store
        # ... and its successor too, once it serves and the programs committed past the kill
        assert wait_until(
            lambda: (
                _controller(run_dir).get("epoch") == 2 and _committed(run_dir) >= killed_at + 40
            ),
            time.monotonic() + 60,
        ), "no progress after the first takeover"
        os.kill(int(_controller(run_dir)["pid"]), signal.SIGKILL)
        killed_at = _committed(run_dir)
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    records = _records(run_dir)
    assert records[-1]["event"] == JOB_END and records[-1]["status"] == "ok", records[-1]

    # taken over twice: the next epochs served, every group adopted each time, none restarted
    takeovers = [r for r in records if r["event"] == "controller.takeover"]
    assert [r["epoch"] for r in takeovers if "epoch" in r] == [2, 3], takeovers
    adopted = [(r["replica"], r["adopted"]) for r in takeovers if "adopted" in r]
    assert sorted(adopted) == sorted([(g, True) for g in range(REPLICAS)] * 2), takeovers
    starts = [r for r in records if r["event"] == PROC_START]
    assert len(starts) == REPLICAS * RANKS, starts  # no program started again
    assert [r for r in records if r["event"] == "group.start"][REPLICAS:] == []
    # each new controller served its tap on a fresh port (never its predecessor's: issue #49)
    assert json.loads((run_dir / "program.json").read_text())["tap_port"] != state["tap_port"]

    # each group's committed steps never went back, reached the end, and went on past the kill
    for g in range(REPLICAS):
        steps = [int(r["step"]) for r in records if r["event"] == STEP_COMMIT and r["replica"] == g]
        assert steps == sorted(steps), (g, steps)
        assert len(steps) == len(set(steps)), (g, "a step committed twice")
        assert max(steps) >= STEPS - 1 > killed_at, (g, max(steps), killed_at)
        for k in range(RANKS):
            log = (run_dir / "logs" / f"replica{g}-rank{k}.log").read_text()
            assert log.count("=== ftharness:") == 1, f"replica {g} rank {k} restarted"
            assert f"train_ddp: group {g} done at step {STEPS}" in log, log[-2000:]
    assert not [r for r in records if r["event"] == "failure"], "a failure after the takeover"


def _listener_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port``."""
    import psutil

    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            return c.pid
    return None
