"""The controller's node lost as a chaos fault (``controller_node_failure``), on the SLURM test
cluster (``bin/test-cluster``, brought up for this module and torn down after it by
test_slurm.py's ``cluster`` fixture): ``ftharness slurm submit`` of an experiment whose one
fault fails the node its controller runs on. The standby on another node takes the run over,
resumes the fault plan, and the run ends ok with nothing restarted.

The job is a user's own torchft program (tests/programs/train_ddp.py, which never imports
ftharness): under SLURM its ``TORCHFT_LIGHTHOUSE`` is its host agent's quorum relay
(``runtime.relay``), which follows the quorum tap to the new controller's node, and its group's
store is served by that agent (``runtime.group_store``), so no program restarts. (The built-in
trainer through the same loss: test_slurm.py's
``test_the_controllers_node_lost_the_run_goes_on_from_another_node``.)

Needs root and Debian's slurm-wlm and munge (``bin/setup``); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from e2e_helpers import events
from test_slurm import _revive_all, _submit, _tiny_toml, _wait_state, cluster, pytestmark

__all__ = ["cluster", "pytestmark"]  # the fixture and the skip marks, for pytest

PROGRAM = Path(__file__).resolve().parents[2] / "tests" / "programs" / "train_ddp.py"

EXPERIMENT = """name = "cnode"
seed = 1
duration_s = 40                 # an upper bound: settle_s ends it once the takeover is over
settle_s = 5                    # > controller_silence
policies = ["in_place"]
job = "{job}"
overrides = ["timeouts.host_timeout=2.0", "timeouts.controller_silence=4.0"]

[hypotheses]
committed_steps_rise = true
every_fault_recovered = true
journal_complete = true
no_orphans = true

[schedule]
kind = "at_times"
at_times = [12]

[faults]
mix = {{ controller_node_failure = 1 }}
"""


def test_a_chaos_fault_fails_the_controllers_node_and_the_run_goes_on(cluster, tmp_path):
    """Three nodes, the first reserved for the controller (n1: the batch script, the keeper,
    the controller and its injector), n2 and n3 a program group each, the standby on n3. The
    injector fails n1 12 s in (once the standby watches): its ``fault.inject`` names n1 and is in
    the journal, the standby's controller on n3 resumes the plan (and writes the fault's heal),
    adopts both groups, the takeover's recovery is linked to the fault and reaches
    participating, no program restarts, the run ends ok."""
    job = _tiny_toml(tmp_path, "cnode-job", name="cnode", steps=1000000, replicas=2)
    job.write_text(
        job.read_text()
        + f"""
[slurm]
controller_node = "reserved"

[program]
kind = "torchft"
command = ["python", {json.dumps(str(PROGRAM))}, "1000000", "0.05"]
progress_timeout_s = 20.0
start_timeout_s = 120.0
"""
    )
    exp = tmp_path / "cnode.toml"
    exp.write_text(EXPERIMENT.format(job=job))
    out = tmp_path / "out"
    t0 = time.monotonic()
    try:
        job_id = _submit(tmp_path, exp, out, "--", "--time=10", nodes=3)
        state = _wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 200)
    finally:
        _revive_all()
    run = out / "chaos" / "in_place"
    standby = run / "logs" / "standby-n3.out"
    said = standby.read_text()[-3000:] if standby.exists() else "(no standby output)"
    slurm_out = out / f"slurm-{job_id}.out"
    said += "\n" + (slurm_out.read_text()[-3000:] if slurm_out.exists() else "(no batch output)")
    records = events(run)
    # the standby's keeper ended the allocation once the run had ended (its batch step died)
    assert state == "CANCELLED", (state, said)
    end = [r for r in records if r["event"] == "job.end"]
    assert end and end[-1]["status"] == "ok", (end, said)
    assert json.loads((run / "keeper.json").read_text())["host"] == "n3"

    (inject,) = [r for r in records if r["event"] == "fault.inject"]
    assert inject["kind"] == "controller_node_failure", inject
    assert inject["target"]["host"] == "n1" and inject["target"]["controller"], inject
    fid = inject["fault_id"]
    heals = [r for r in records if r["event"] == "fault.heal" and r["fault_id"] == fid]
    assert heals and not heals[0].get("error"), heals
    assert [r for r in records if r["event"] == "controller.takeover"], said
    assert inject["t"] < min(r["t"] for r in records if r["event"] == "controller.takeover")

    # the takeover's recovery is the fault's, and it reached participating
    phases = [r for r in records if r["event"] == "recovery.phase"]
    takeover = {r["phase"] for r in phases if r["cause"] == "controller_crash"}
    assert {"detected", "participating"} <= takeover, phases
    assert {r["fault_id"] for r in phases if r["cause"] == "controller_crash"} == {fid}
    # nothing restarted: both groups adopted, one start each, no failure of a group, and each
    # program started once and committed on after the takeover
    adopted = sorted((r["replica"], r["adopted"]) for r in records if "adopted" in r)
    assert adopted == [(0, True), (1, True)], (adopted, said)
    starts = [r for r in records if r["event"] == "group.start"]
    assert sorted(r["replica"] for r in starts) == [0, 1], starts
    assert not [r for r in records if r["event"] == "failure" and "replica" in r]
    t_takeover = min(r["t"] for r in records if r["event"] == "controller.takeover")
    for replica in (0, 1):
        log = (run / "logs" / f"replica{replica}-rank0.log").read_text()
        assert log.count("=== ftharness:") == 1, f"replica {replica} restarted"
        commits = [r for r in records if r["event"] == "step.commit" and r["replica"] == replica]
        steps = [r["step"] for r in commits]
        assert steps == sorted(set(steps)), replica  # none went back, none twice
        assert [r for r in commits if r["t"] > t_takeover], (replica, said)
    # the `ftharness chaos` process died with n1: the standby finished the experiment
    # (`ftharness chaos --resume`): the run's post-run check, and the experiment's report
    checked = json.loads((run / "postrun.json").read_text())
    said += f"\npostrun: {checked}"
    report = json.loads((run.parent / "report.json").read_text())
    assert report["hypotheses"] and report["passed"], (report["hypotheses"], said)
    print(f"took {time.monotonic() - t0:.0f} s")
