"""What a run writes is its user's alone: worker logs (which hold tracebacks and whatever the
model code prints) are created 0600 by the host agent that forks the worker."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from runtime.controller import Controller
from runtime.spec import ControllerSpec, HeartbeatSpec


@pytest.mark.timeout(60)
def test_worker_logs_are_private(tmp_path: Path) -> None:
    spec = ControllerSpec(heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=2.0), preload=())
    ctl = Controller(spec, on_failure=lambda f: True)
    try:
        host = ctl.spawn_host("h0")
        host.spawn_procs({"replicas": 1}, log_dir=str(tmp_path))
        logs = list(tmp_path.glob("*.log"))
        assert logs, "the worker wrote no log file"
        for log in logs:
            assert stat.S_IMODE(log.stat().st_mode) == 0o600, log
    finally:
        ctl.shutdown(grace_s=0.5)
