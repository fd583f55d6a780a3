"""A host whose agent cannot be started again, in a real job (local launcher): its groups wait
for a host, the agent is tried ``recovery.host_max_restarts`` times, then the host is given up,
and with no host left the job fails with the reason instead of retrying forever (issue #30: "could
not restart the agent of rack1-b ...", repeated)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

import harness.job.launch as launch
from harness.config import load_config
from harness.job.site import Site, resolve
from runtime.journal import read_journal
from runtime.launchers import LocalLauncher

pytestmark = pytest.mark.timeout(120)


class _GoneAfterFirstStart(LocalLauncher):
    """A host's agent starts once; every later start fails, as on a machine that is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[str] = []

    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        self.starts.append(name)
        if len(self.starts) > 1:
            raise RuntimeError(f"{name} cannot be reached (its machine is gone)")
        super().start(name, boot)


def test_a_job_whose_only_host_cannot_come_back_fails_with_the_reason(tmp_path, monkeypatch):
    cfg = load_config(
        "experiments/tiny.toml",
        ["hosts=1", "replicas=2", "steps=100000", "recovery.spares_per_host=0",
         "checkpoint.every_steps=0", "recovery.host_max_restarts=3"],
    )  # fmt: skip
    launcher = _GoneAfterFirstStart()
    monkeypatch.setattr(launch, "prepare_site", lambda c, d, say=None: Site(resolve(c), launcher))

    def started(job: Any) -> None:
        def evict() -> None:
            deadline = time.monotonic() + 60
            while job.faults.committed_step() < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            job.faults.kill_host("host0")

        threading.Thread(target=evict, daemon=True).start()

    out = launch.run_job(cfg, tmp_path, quiet=True, on_started=started, timeout=90)
    assert out["status"] == "failed"
    assert out["reason"].startswith("no host left to run a replica group on: host0: "), out
    assert "restart intensity exceeded: 3 restarts" in out["reason"]
    assert "its machine is gone" in out["reason"]  # the last error, said
    assert launcher.starts == ["host0"] * 4  # the first start and 3 restarts, no more
    end = [r for r in read_journal(tmp_path / "journal.jsonl") if r["event"] == "job.end"]
    assert end[0]["status"] == "failed" and end[0]["reason"] == out["reason"]
