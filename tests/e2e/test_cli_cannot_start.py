"""A job whose host agent cannot serve it, as a user sees it: ``ftharness run`` and ``ftharness
chaos`` with ``network.cidr`` naming a network the host has no address in (its agent refuses the
job: ``runtime.host_registry.AgentRefused``) say why and exit 1, with no Python traceback; the
journal ends the run with that reason and the report shows it.

The local launcher is enough (its agent chooses its address the same way), so no root is needed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from e2e_helpers import chaos_argv

from runtime.journal import read_journal

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CIDR = "10.99.0.0/16"
REFUSED = f"network.cidr = '{CIDR}': no address of this host is in it"


def _no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr[-3000:]


def test_run_says_why_the_agent_refused_and_exits_1_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out", str(out),
         "--set", "replicas=1", "--set", f"network.cidr={CIDR}"],
        capture_output=True, text=True, timeout=100, cwd=REPO,
    )  # fmt: skip
    print(done.stdout[-2000:], done.stderr[-3000:])
    assert done.returncode == 1, done.stderr[-3000:]
    _no_traceback(done)
    assert "tiny: failed — 0 steps committed" in done.stdout
    lines = done.stderr.splitlines()
    said = [ln for ln in lines if ln.startswith("the job could not start: host agent host0")]
    assert said and REFUSED in said[0], done.stderr[-3000:]
    (end,) = [r for r in read_journal(out / "journal.jsonl") if r["event"] == "job.end"]
    assert end["status"] == "failed" and REFUSED in end["reason"]


def test_chaos_says_why_the_agent_refused_and_exits_1_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "exp.toml").write_text(
        textwrap.dedent(
            f"""
            name = "refused"
            seed = 1
            duration_s = 5
            policies = ["in_place"]

            [job]
            name = "refused"
            replicas = 1
            ranks = 1
            steps = 100
            network = {{ cidr = "{CIDR}" }}

            [schedule]
            kind = "at_times"
            at_times = [2]

            [faults]
            mix = {{ kill = 1 }}
            """
        )
    )
    done = subprocess.run(
        chaos_argv(tmp_path), capture_output=True, text=True, timeout=100, cwd=REPO
    )
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 1, done.stderr[-3000:]
    _no_traceback(done)
    assert "run in_place failed:\nthe job could not start: host agent host0" in done.stderr
    assert REFUSED in done.stderr
    # the report, from the journal alone, says it too
    assert "- `in_place`: **failed**, 0 step(s) committed" in done.stdout
    report = (tmp_path / "run" / "report.md").read_text()
    assert REFUSED in report
