"""Every fault kind of the catalogue fires for real in a real job (``ftharness chaos``), and
the job recovers: the fault is journaled before it fires, the failure (if it causes one) is
detected with the right cause, and training commits steps again afterwards."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from e2e_helpers import chaos_argv

from runtime.journal import read_journal

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]

# kind -> (target kind, fault options, expected failure causes (empty: no process fails))
KINDS = {
    "segfault": ("replica", "", {"signal"}),
    "kill": ("replica", "", {"signal"}),
    "collective_abort": ("replica", "", set()),
    "gil_deadlock": ("replica", "", {"missed_heartbeat"}),
    "hang": ("replica", "hold_s = 8.0", {"missed_heartbeat"}),
    "host_eviction": ("host", "cooldown_s = 3.0", {"lost_host", "signal"}),
    # the default quorum service (the tree's) lives in the controller: it restarts, no process
    # fails; torchft's Lighthouse is a worker process that the fault SIGKILLs
    "lighthouse_crash": ("default", "", set()),
    "lighthouse_crash/torchft": ("default", "", {"signal"}),
    "slow_rank": ("replica", "hold_s = 3.0\ndelay_s = 0.3", set()),
}


# A Lighthouse crash drops the quorum requests in flight; they can hang until quorum_timeout
# before the trainers ask the restarted one, so that run gets short quorum timeouts.
QUICK_QUORUM = "quorum_timeout = 4.0, lighthouse_join_timeout = 3.0, process_group_timeout = 3.0, "


def experiment(case: str) -> str:
    target, options, _ = KINDS[case]
    kind, _, backend = case.partition("/")
    quorum = QUICK_QUORUM if kind == "lighthouse_crash" else ""
    recovery = f'recovery = {{ quorum = "{backend}" }}' if backend else ""
    targets = (
        'kind = "host"\nhosts = ["host1"]'
        if target == "host"
        else 'kind = "default"'
        if target == "default"
        else 'kind = "replica"\nreplicas = [1]'
    )
    return textwrap.dedent(
        f"""
        name = "kind-{kind}"
        seed = 3
        duration_s = 40                # an upper bound: the run ends once its fault is over
        settle_s = 4
        policies = ["in_place"]

        [job]
        name = "kind-{kind}"
        replicas = 3
        ranks = 1
        hosts = 2
        steps = 100000
        checkpoint = {{ every_steps = 0 }}
        timeouts = {{ {quorum}heartbeat_interval = 0.1, heartbeat_timeout = 1.0 }}
        {recovery}

        [schedule]
        kind = "at_times"
        at_times = [4]

        [faults]
        mix = {{ {kind} = 1 }}

        [faults.options.{kind}]
        {options}

        [targets]
        {targets}
        keep_alive = {{ replicas = [0] }}

        [hypotheses]
        loss_finite = true
        committed_steps_rise = true
        replicas_equal_after_heal = true
        """
    )


@pytest.mark.parametrize("case", sorted(KINDS))
def test_fault_kind_fires_for_real_and_the_job_recovers(case, tmp_path):
    kind = case.partition("/")[0]
    (tmp_path / "exp.toml").write_text(experiment(case))
    done = subprocess.run(
        chaos_argv(tmp_path, "--quiet"),
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
    )
    records = read_journal(tmp_path / "run")
    injected = [r for r in records if r["event"] == "fault.inject"]
    assert [r["kind"] for r in injected] == [kind], done.stderr[-3000:]
    t_fault = injected[0]["t"]
    causes = {r["cause"] for r in records if r["event"] == "failure" and r["t"] >= t_fault}
    expected = KINDS[case][2]
    assert causes <= expected and (causes or not expected), (causes, expected)
    after = [r for r in records if r["event"] == "step.commit" and r["t"] > t_fault + 1.0]
    assert {r["replica"] for r in after} == {0, 1, 2}, "not every group trains again"
    # the hypotheses (loss finite, progress after the fault, replicas equal) held
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # and the run ended once the fault was over (settle_s), not at its upper bound
    end = next(r for r in records if r["event"] == "job.end")
    assert end["status"] == "ok" and "settle_s" in end["reason"], end
    # the journal tells the whole story of the recovery, in order
    if expected:
        phases = [
            r["phase"] for r in records if r["event"] == "recovery.phase" and r["t"] >= t_fault
        ]
        assert phases[0] == "detected" and "participating" in phases, phases
