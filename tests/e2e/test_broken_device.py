"""A failure that is one group's own drops that group, and the job goes on (issue #50), through
the real CLI and real processes: the ``broken_device`` fault makes group R fail every step, in
every incarnation, with a CUDA-like error that no injected one-off fault explains. After
``recovery.deterministic_max`` (3) deaths of that group while the others commit on, the
controller says the cause is in group R alone, journals ``group.dropped``, restarts it no more,
and the other two groups train to the end of the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from e2e_helpers import chaos_argv, events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).parents[2]

EXPERIMENT = """
name = "broken-device-e2e"
seed = 3
duration_s = 30                 # an upper bound: settle_s ends it once the fault is over
settle_s = 5
policies = ["in_place"]

[job]
name = "broken-device-e2e"
replicas = 3
ranks = 1
hosts = 1
steps = 100000
model = { kind = "tiny", dim = 64, layers = 2, heads = 4 }
checkpoint = { every_steps = 0 }

[schedule]
kind = "at_times"
at_times = [5]

[faults]
mix = { broken_device = 1 }

[targets]
kind = "default"

[hypotheses]
committed_steps_rise = true
every_fault_recovered = true   # the hit group's recovery ends in its drop (phase "dropped")
journal_complete = true
"""


def test_a_group_whose_device_is_broken_is_dropped_and_the_others_train_on(tmp_path):
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=220
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    run = tmp_path / "run" / "in_place"
    (fault,) = events(run, "fault.inject")
    assert fault["kind"] == "broken_device" and fault["recurs"] is True
    hit = fault["target"]["replica"]

    (drop,) = events(run, "group.dropped")
    assert drop["replica"] == hit and drop["left"] == 2
    assert f"only group {hit} fails" in drop["reason"]
    assert "CUDA error: uncorrectable ECC error" in drop["reason"]
    assert f"group {hit} dropped, 2 group(s) train on" in out

    counted = [s for s in events(run, "failure.signature") if s.get("counted")]
    assert [s["replica"] for s in counted] == [hit] * 3
    # the hit incarnation and two restarts, then no more
    assert len([g for g in events(run, "group.start") if g["replica"] == hit]) == 3
    commits = events(run, "step.commit")
    drop_t = drop["t"]
    after = {c["replica"] for c in commits if c["t"] > drop_t + 1.0}
    assert after == {0, 1, 2} - {hit}  # the others go on; the dropped one commits nothing
    (end,) = events(run, "job.end")
    assert end["status"] == "ok"
    assert max(c["step"] for c in commits) > max(
        c["step"] for c in commits if c["t"] <= drop_t
    )  # training went on past the drop
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Groups dropped: `in_place`" in report and f"only group {hit} fails" in report
    (ended,) = [r for r in events(run, "recovery.phase") if r["phase"] == "dropped"]
    assert ended["replica"] == hit and ended["fault_id"] == fault["fault_id"]
    assert "ended in the group's drop" in report


def test_a_dropped_group_stays_dropped_when_the_controller_is_taken_over(tmp_path):
    """The controller dies after the drop: its successor reads ``group.dropped`` in the journal,
    adopts the other two groups and neither adopts nor restarts the dropped one (before, it
    started it again, to crash-loop a second time)."""
    exp = EXPERIMENT.replace("at_times = [5]", "at_times = [5, 10]").replace(
        "mix = { broken_device = 1 }", "mix = { broken_device = 1, controller_crash = 1 }"
    )  # seed 3 draws broken_device, then controller_crash
    # no settle_s: with a controller crash in the mix it would be over 10 s (controller_silence)
    exp = exp.replace("settle_s = 5", "").replace("duration_s = 30", "duration_s = 24")
    (tmp_path / "exp.toml").write_text(exp)
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=220
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    run = tmp_path / "run" / "in_place"
    assert [f["kind"] for f in events(run, "fault.inject")] == ["broken_device", "controller_crash"]
    hit = events(run, "fault.inject")[0]["target"]["replica"]
    (drop,) = events(run, "group.dropped")
    assert drop["replica"] == hit
    takeover = next(r for r in events(run, "controller.takeover") if r.get("epoch") == 2)
    assert takeover["t"] > drop["t"]
    adopted = {r["replica"] for r in events(run, "controller.takeover") if r.get("adopted")}
    assert adopted == {0, 1, 2} - {hit}
    assert [g for g in events(run, "group.start") if g["t"] > takeover["t"]] == []
    commits = events(run, "step.commit")
    assert {c["replica"] for c in commits if c["t"] > takeover["t"] + 1.0} == {0, 1, 2} - {hit}
    (end,) = events(run, "job.end")
    assert end["status"] == "ok"
