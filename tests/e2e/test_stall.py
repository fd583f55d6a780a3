"""No silent stall (issue #30, item 3): a job whose groups cannot rendezvous ends with a diagnosis.

Real trainers on the local launcher; after a few steps every rank's process group advertises its
rendezvous store at a port where nothing listens (``stall_hooks``), so every step from then on
aborts with torch's own connection error, and nothing dies: the job must end on its own, within
``timeouts.no_progress``, naming the endpoint.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
from e2e_helpers import after_step, events, tiny_cfg
from stall_hooks import advertise_a_refusing_store, closed_port

from experiments.report import main as report_main
from harness.job.launch import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NO_PROGRESS = 8.0
QUICK = (
    "replicas=2",
    "steps=100000",
    "recovery.spares_per_host=0",
    "checkpoint.every_steps=0",
    "timeouts.heartbeat_timeout=1.0",
    "timeouts.process_group_timeout=2.0",
    "timeouts.lighthouse_join_timeout=2.0",
    "timeouts.quorum_timeout=3.0",
    "timeouts.manager_timeout=3.0",
    f"timeouts.no_progress={NO_PROGRESS}",
)


def test_a_job_whose_groups_cannot_rendezvous_ends_with_a_diagnosis(tmp_path, capfd):
    port = closed_port()
    broken: dict[str, float] = {}

    def started(job):
        def break_rendezvous():
            broken["t"] = time.time()
            job.in_every_trainer(advertise_a_refusing_store, port)

        after_step(job, 3, break_rendezvous)

    out = run_job(tiny_cfg(*QUICK), tmp_path, on_started=started, timeout=100)
    t_end = time.time()
    err = capfd.readouterr().err

    assert out["status"] == "failed", out
    assert out["reason"].startswith("no step committed for"), out["reason"]
    assert f":{port}" in out["reason"], out["reason"]  # the failing endpoint, named
    # the error quoted: torch's, or MemberGone where the probe before a process group's
    # configure found the advertised store refusing (harness.rank.torchft_glue)
    assert "Dist" in out["reason"] or "MemberGone" in out["reason"], out["reason"]
    records = events(tmp_path)
    aborts = [r for r in records if r["event"] == "step.abort" and r["t"] > broken["t"]]
    assert aborts, "no step aborted"
    stall = [r for r in records if r["event"] == "job.stall"]
    assert len(stall) == 1 and stall[0]["endpoint"].endswith(f":{port}"), stall
    assert sorted(stall[0]["replicas"]) == [0, 1]
    end = [r for r in records if r["event"] == "job.end"]
    assert end[0]["status"] == "failed" and end[0]["reason"] == out["reason"]
    # Ended within the limit of the first abort (and a generous margin for a busy machine).
    first_abort = min(r["t"] for r in aborts)
    assert NO_PROGRESS <= t_end - first_abort < NO_PROGRESS + 15, t_end - first_abort
    # The console said so while it happened: the progress line with the aborts and their last
    # error, the warning past half the limit, and the diagnosis.
    lines = err.splitlines()
    assert any("aborted (last: " in ln and "groups " in ln for ln in lines), err[-3000:]
    assert any("warning: no step committed for" in ln for ln in lines), err[-3000:]
    assert any(ln.startswith("[ftharness] stalled: ") and f":{port}" in ln for ln in lines)
    # ... and the report says why the run failed, from the journal alone (text and JSON).
    report_main(argparse.Namespace(run_dir=str(tmp_path), json=False, html=False))
    text = capfd.readouterr().out
    assert "- `in_place`: **failed**" in text, text
    stalled = next(ln for ln in text.splitlines() if ln.startswith("  - stalled: "))
    assert f"failing endpoint: `{stall[0]['endpoint']}`" in stalled, stalled
    assert f"  - diagnosis: {out['reason']}" in text
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["outcome"]["in_place"]["stall"]["endpoint"].endswith(f":{port}")
