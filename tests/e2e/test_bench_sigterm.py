"""A bench stopped with SIGTERM (a CI job's timeout, ``kill``) cleans up as after Ctrl-C:
``ftharness bench multihost`` killed while its test hosts run leaves no network namespace,
bridge or host agent behind, and says it was interrupted (exit code 130).

Needs root (CI is root); skipped with the reason otherwise.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import our_namespaces

from runtime.launchers import netns

ok, why = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150), pytest.mark.skipif(not ok, reason=why)]

ROOT = Path(__file__).resolve().parents[2]


def _links(tags: set[str]) -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(t in line for t in tags)]


def test_a_bench_killed_with_sigterm_leaves_no_namespace_link_or_agent_behind():
    before = our_namespaces()
    bench = subprocess.Popen(
        [sys.executable, "-m", "harness", "bench", "multihost", "--reps", "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not (ours := our_namespaces() - before) and time.monotonic() < deadline:
        assert bench.poll() is None, bench.communicate()[0][-3000:]
        time.sleep(0.2)
    assert ours, "the bench never made its test hosts"
    time.sleep(3.0)  # its agents are up and training
    tags = {name.split("-")[0] for name in ours}
    bench.send_signal(signal.SIGTERM)
    out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 130, out[-3000:]
    assert "interrupted" in out, out[-3000:]
    assert our_namespaces() & ours == set(), out[-3000:]
    assert _links(tags) == [], out[-3000:]
    agents = subprocess.run(["pgrep", "-f", "runtime.agent"], capture_output=True, text=True)
    assert agents.stdout.strip() == "", agents.stdout
