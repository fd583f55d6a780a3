"""``controller_crash`` in a chaos experiment, run through the CLI as a user runs it: a group is
killed, and while it recovers the controller is SIGKILLed too (``phase = "heal"``), twice. A
standby takes the job over each time, continues the open recovery and the fault plan, and the
report holds every hypothesis: every fault recovered (the takeovers among them), replicas equal,
the journal complete, nothing left behind. The soak (tests/e2e/test_soak.py) has the crash among
every other kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.journal import CONTROLLER_TAKEOVER, FAULT_INJECT, RECOVERY_PHASE, read_journal

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]
EXPERIMENT = """
name = "controller_crash_heal"
seed = 25                             # the plan: kill, controller_crash, kill, controller_crash
duration_s = 30
policies = ["in_place"]
job = "{tiny}"
overrides = ["steps=1000000"]

[schedule]
kind = "at_times"
at_times = [8, 8, 16, 16]       # each crash due with a kill: it waits for that heal

[faults]
mix = {{ controller_crash = 1, kill = 1 }}

[faults.options.controller_crash]
phase = "heal"                        # while the killed group recovers

[targets]
keep_alive = {{ replicas = [0], last_healthy = true }}

[hypotheses]
committed_steps_rise = true
replicas_equal_after_heal = true
every_fault_recovered = true
journal_complete = true
no_orphans = true
no_shm_left = true
"""


def test_the_controller_killed_while_a_group_heals_is_taken_over_and_the_heal_finishes(tmp_path):
    experiment = tmp_path / "cc.toml"
    experiment.write_text(EXPERIMENT.format(tiny=REPO / "experiments" / "tiny.toml"))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "chaos", str(experiment), "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    failed = {h["name"]: h["detail"] for h in report["hypotheses"] if not h["passed"]}
    assert not failed, (failed, tail)
    assert done.returncode == 0, tail
    records = read_journal(out / "in_place" / "journal.jsonl")
    injected = [r for r in records if r["event"] == FAULT_INJECT]
    assert [r["kind"] for r in injected] == ["kill", "controller_crash"] * 2
    # both crashes waited for the heal, and found it
    assert [(r.get("phase"), r.get("ready")) for r in injected[1::2]] == [("heal", True)] * 2
    takeovers = [r for r in records if r["event"] == CONTROLLER_TAKEOVER and "epoch" in r]
    assert [r["epoch"] for r in takeovers] == [2, 3], tail
    # each killed group's recovery, open when its controller died, reached participating under
    # the id it was opened with; each takeover is a recovery of its own, linked to its crash
    phases: dict[str, set[str]] = {}
    causes: dict[str, tuple[str, str | None]] = {}
    for r in records:
        if r["event"] == RECOVERY_PHASE:
            phases.setdefault(r["recovery_id"], set()).add(r["phase"])
            causes.setdefault(r["recovery_id"], (r["cause"], r.get("fault_id")))
    assert all("participating" in p for p in phases.values()), phases
    crashes = sorted(f for c, f in causes.values() if c == "controller_crash")
    assert crashes == ["f001", "f003"], causes
    # no worker was restarted by a takeover: the only processes started after the first are
    # the killed groups' replacements (one each) and the spares that replaced those
    starts = [r for r in records if r["event"] == "group.start"]
    assert len(starts) == 3 + 2, [(r["replica"], r["incarnation"]) for r in starts]


WEDGE = """
name = "controller_wedge"
seed = 1
duration_s = 35                 # an upper bound: settle_s ends it once the takeover is over
settle_s = 5                    # > controller_silence
policies = ["in_place"]
job = "{tiny}"
overrides = ["steps=1000000", "timeouts.controller_silence=4"]

[schedule]
kind = "at_times"
at_times = [6]

[faults]
mix = {{ controller_crash = 1 }}

[faults.options.controller_crash]
how = "wedge"                         # its control plane's lock taken and never given back

[hypotheses]
committed_steps_rise = true
replicas_equal_after_heal = true
every_fault_recovered = true
journal_complete = true
no_orphans = true
"""


def test_a_deadlocked_controller_stops_beating_and_is_taken_over(tmp_path):
    """The keeper watches a beat that needs the control plane's lock: a controller alive but
    deadlocked on it is killed after ``timeouts.controller_silence`` and taken over, nothing
    restarted (the quorum service kept serving meanwhile: it has locks of its own)."""
    experiment = tmp_path / "wedge.toml"
    experiment.write_text(WEDGE.format(tiny=REPO / "experiments" / "tiny.toml"))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "chaos", str(experiment), "--out", str(out)],
        capture_output=True, text=True, timeout=200, cwd=REPO,
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    failed = {h["name"]: h["detail"] for h in report["hypotheses"] if not h["passed"]}
    assert not failed, (failed, tail)
    assert done.returncode == 0, tail
    assert "the controller wedged" in done.stderr and "has not been heard from" in done.stderr
    records = read_journal(out / "in_place" / "journal.jsonl")
    (crash,) = [r for r in records if r["event"] == FAULT_INJECT]
    assert crash["how"] == "wedge"
    takeovers = [r for r in records if r["event"] == CONTROLLER_TAKEOVER and "epoch" in r]
    assert [r["epoch"] for r in takeovers] == [2], tail
    assert len([r for r in records if r["event"] == "group.start"]) == 3  # none restarted
