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
duration_s = 20
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
