"""When a SLURM allocation is over, read from what SLURM's commands print
(``runtime.launchers.slurm_text``); the end-to-end case is in tests/e2e/test_slurm.py."""

from __future__ import annotations

import pytest

from runtime.launchers.slurm_text import SRUN_JOB_GONE, allocation_end


@pytest.mark.parametrize("state", ["CANCELLED", "CANCELLED+", "COMPLETING", "TIMEOUT", "NODE_FAIL"])
def test_a_job_in_a_terminal_state_has_ended(state):
    assert allocation_end("42", state) == f"SLURM job 42 is {state.rstrip('+')}"


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", "SUSPENDED", "CONFIGURING"])
def test_a_running_job_has_not(state):
    assert allocation_end("42", state) is None


def test_a_job_slurm_no_longer_knows_has_ended():
    assert "no longer knows job 42" in str(allocation_end("42", None))


def test_what_srun_says_in_a_job_that_is_gone():
    # measured: srun --jobid of a cancelled job (slurm-wlm 22.05)
    log = (
        "srun: error: Slurm job 1 has expired\n"
        "srun: Check SLURM_JOB_ID environment variable. Expired or invalid job 1\n"
    )
    assert SRUN_JOB_GONE.findall(log)[-1].endswith("Expired or invalid job 1")
    assert SRUN_JOB_GONE.findall("srun: error: Unable to confirm allocation for job 7: "
                                 "Invalid job id specified")  # fmt: skip
    # a step of ours cancelled (cancel_step, a node failure) is not the job
    step = "srun: Job step aborted: Waiting up to 7 seconds\nslurmstepd: *** STEP 1.0 CANCELLED"
    assert not SRUN_JOB_GONE.findall(step)
