"""``runtime.proctree.reap_within``: a child that another wait of ours already reaped is gone,
not a child to wait ``timeout_s`` for (the keeper's ``waitpid(-1)`` loop reaps its standby's
``srun``; its close then waited 10 s for nothing, and a cancelled SLURM job outlived SLURM's
KillWait: tests/e2e/test_slurm.py)."""

from __future__ import annotations

import os
import subprocess
import time

from runtime.proctree import reap_within


def test_a_child_reaped_elsewhere_counts_as_reaped_at_once():
    child = subprocess.Popen(["true"])
    os.waitpid(child.pid, 0)  # as a subreaper's wait-for-any loop would
    t0 = time.monotonic()
    assert reap_within(child.pid, 5.0)
    assert time.monotonic() - t0 < 1.0
    child.returncode = 0  # reaped: Popen must not wait for it again


def test_a_child_that_exits_in_time_is_reaped_and_one_that_does_not_is_not():
    quick = subprocess.Popen(["sleep", "0.2"])
    assert reap_within(quick.pid, 5.0)
    quick.returncode = 0
    slow = subprocess.Popen(["sleep", "30"])
    try:
        assert not reap_within(slow.pid, 0.3)
    finally:
        slow.kill()
        slow.wait()
