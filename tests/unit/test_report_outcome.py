"""How a run ended, in ``ftharness report`` (text and JSON), from a hand-written journal alone: a
stall's diagnosis (``job.stall``), a preflight that stopped the job before training, and one that
kept a late-joining host out while the job trained on."""

from __future__ import annotations

import argparse
import json

from experiments.report import main as report_main
from runtime.journal import Journal

ENDPOINT = "10.251.0.3:40123"
DIAGNOSIS = (
    "no step committed for 8 s (timeouts.no_progress = 8) while replica groups 0, 1 kept "
    f"aborting steps: 12 aborted; failing endpoint {ENDPOINT} (named by 12 of them): the groups "
    "cannot reach it (a wrong address advertised, a firewall, a cut link); last error "
    "(replica 1 on host1): DistNetworkError: failed to connect"
)
TABLE = (
    "preflight failed: 1 of 6 network path(s) do not work (checked in 1.01 s); {what}\n"
    "  from   to     address          result     why\n"
    "  host1  host0  10.251.0.2:41000  timed out  no reply to the connection request within 1 s"
)
CELL = {
    "src": "host1", "dst": "host0", "address": "10.251.0.2", "port": 41000,
    "outcome": "timed out", "detail": "no reply within 1 s", "seconds": 1.0,
}  # fmt: skip


def _report(run_dir, capsys) -> tuple[int, str, dict]:
    rc = report_main(argparse.Namespace(run_dir=str(run_dir), json=False, html=False))
    text = capsys.readouterr().out
    return rc, text, json.loads((run_dir / "report.json").read_text())["summary"]["outcome"]


def test_a_stalled_run_shows_its_diagnosis_and_a_kept_out_host(tmp_path, capsys):
    j = Journal(tmp_path / "journal.jsonl", job="t", policy="in_place")
    j.emit("job.start", config={}, replicas=2, ranks=1)
    j.emit("preflight", status="ok", reason="", seconds=0.01, hosts=["host0", "host1"],
           paths=6, failed=0, matrix=[])  # fmt: skip
    for step in (1, 2, 3):
        for rep in (0, 1):
            j.emit("step.commit", replica=rep, rank=0, step=step, loss=1.0, samples=4)
    what = "host host1 is not used (its agent joined late; the job trains on without it)"
    j.emit("preflight", status="failed", reason=TABLE.format(what=what), seconds=1.01,
           host="host1", hosts=["host1", "host0"], paths=3, failed=1, matrix=[CELL])  # fmt: skip
    for _ in range(6):
        for rep in (0, 1):
            j.emit("step.abort", replica=rep, rank=0, step=4, reason="DistNetworkError: ...")
    j.emit("job.stall", seconds=8.2, aborts=12, replicas=[0, 1], endpoint=ENDPOINT,
           error="DistNetworkError: failed to connect", error_type="DistNetworkError",
           diagnosis=DIAGNOSIS)  # fmt: skip
    j.emit("job.end", status="failed", reason=DIAGNOSIS, steps=3, seconds=30.0)
    j.close()
    rc, text, outcome = _report(tmp_path, capsys)
    assert rc == 0  # no hypotheses: the report is about the numbers
    print(text)
    assert "## How the run ended" in text
    assert "- `in_place`: **failed**, 3 step(s) committed" in text
    assert (
        "  - stalled: no step committed for 8 s, 12 aborted step(s) of replica group(s) 0, 1; "
        f"failing endpoint: `{ENDPOINT}` (DistNetworkError)"
    ) in text
    assert f"  - diagnosis: {DIAGNOSIS}" in text
    assert text.count(DIAGNOSIS) == 1  # the job.end reason is the diagnosis: said once
    kept = "  - preflight failed, host host1 (joined late) was kept out, the job trained on:"
    assert kept in text
    assert "    host1  host0  10.251.0.2:41000  timed out" in text
    assert "  - kept out by their preflight at the end: host1" in text
    o = outcome["in_place"]
    assert o["status"] == "failed" and o["steps"] == 3 and o["reason"] == DIAGNOSIS
    assert o["stall"]["endpoint"] == ENDPOINT and o["stall"]["error_type"] == "DistNetworkError"
    assert o["stall"]["replicas"] == [0, 1] and o["stall"]["aborts"] == 12
    (p,) = o["preflight_failed"]
    assert p["host"] == "host1" and p["failed"] == 1
    assert p["failed_paths"] == [{k: CELL[k] for k in p["failed_paths"][0]}]
    assert o["kept_out"] == ["host1"]


def test_a_run_stopped_by_the_preflight_and_one_that_ended_well(tmp_path, capsys):
    a = Journal(tmp_path / "a.jsonl", job="t", policy="full_restart")
    a.emit("job.start", config={}, replicas=2, ranks=1)
    table = TABLE.format(what="training was not started")
    a.emit("preflight", status="failed", reason=table, seconds=1.01, hosts=["host0", "host1"],
           paths=6, failed=1, matrix=[CELL])  # fmt: skip
    a.emit("job.end", status="failed", reason=table, steps=0, seconds=3.0)
    a.close()
    b = Journal(tmp_path / "b.jsonl", job="t", policy="in_place")
    b.emit("job.start", config={}, replicas=2, ranks=1)
    b.emit("step.commit", replica=0, rank=0, step=1, loss=1.0, samples=4)
    b.emit("job.end", status="ok", reason="", steps=1, seconds=3.0)
    b.close()
    _, text, outcome = _report(tmp_path, capsys)
    assert "- `full_restart`: **failed**, 0 step(s) committed" in text
    assert "  - preflight failed, the job stopped before training:" in text
    assert text.count("training was not started") == 1  # the reason is the table: once
    assert "- `in_place`: **ok**, 1 step(s) committed" in text
    assert outcome["in_place"]["stall"] is None and outcome["in_place"]["preflight_failed"] == []
    assert outcome["full_restart"]["preflight_failed"][0]["host"] is None


def test_a_run_that_could_not_start_says_why(tmp_path, capsys):
    j = Journal(tmp_path / "journal.jsonl", job="t", policy="in_place")
    why = "the job could not start: host agent host0 cannot serve this job: no address"
    j.emit("job.start", config={}, replicas=1, ranks=1)
    j.emit("job.end", status="failed", reason=why, steps=0, seconds=1.0)
    j.close()
    _, text, _ = _report(tmp_path, capsys)
    assert f"  - reason:\n\n    ```\n    {why}\n    ```" in text
