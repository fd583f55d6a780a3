"""A program of the user's own under ftharness: tests/programs/train_ddp.py, a plain torchft
program that never imports ftharness, supervised, faulted and measured from outside."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from e2e_helpers import chaos_argv, events, fault_recoveries

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "train_ddp.py"
EXPERIMENT = ROOT / "tests" / "programs" / "chaos_train_ddp.toml"


def _write_experiment(path: Path, quorum: str, edits: dict[str, str] | None = None) -> dict:
    """tests/programs/chaos_train_ddp.toml with ``quorum``, the program's absolute path, and
    whole lines replaced (``edits``: line prefix -> new line)."""
    text = EXPERIMENT.read_text()
    assert 'quorum = "torchft"' in text and '"tests/programs/train_ddp.py"' in text
    text = text.replace('quorum = "torchft"', f'quorum = "{quorum}"')
    text = text.replace('"tests/programs/train_ddp.py"', json.dumps(str(PROGRAM)))
    lines = text.splitlines()
    for prefix, new in (edits or {}).items():
        hits = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(hits) == 1, prefix
        lines[hits[0]] = new
    path.write_text("\n".join(lines) + "\n")
    return tomllib.loads(path.read_text())


@pytest.mark.timeout(360)
@pytest.mark.parametrize("quorum", ["torchft", "tree"])
def test_unmodified_program_recovers_from_kill_segfault_and_hang(tmp_path, quorum):
    data = _write_experiment(tmp_path / "exp.toml", quorum)
    steps = int(data["job"]["program"]["command"][2])
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=330
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    run = tmp_path / "run" / "in_place"

    # every group reached the last step: its last incarnation's log says so, and the quorum
    # service saw it ask for a quorum after committing the step before (the last commit
    # itself is followed by no request: see harness/job/program/groups.py)
    for r in range(data["job"]["replicas"]):
        log = (run / "logs" / f"replica{r}-rank0.log").read_text()
        last = log.rsplit("=== ftharness:", 1)[1]
        assert f"train_ddp: group {r} done at step {steps}" in last, last[-2000:]
        commits = [c["step"] for c in events(run, "step.commit") if c["replica"] == r]
        assert max(commits) == steps - 1

    # each fault fired, took down its group, and its recovery has every figure
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["passed"], report["hypotheses"]
    recs = fault_recoveries(run, report["summary"]["policies"]["in_place"]["recoveries"])
    if sorted(r["kind"] for r in recs) != ["hang", "kill", "segfault"]:
        pytest.fail(_explain(run, recs, out), pytrace=False)
    for r in recs:
        for key in ("detection_s", "stall_s", "participate_s", "steps_lost"):
            assert r[key] is not None, (key, r)
        assert {"detected", "replacement_started", "healed", "participating"} <= set(r["phases"])
    causes = {f["signal"] or f["cause"] for f in events(run, "failure") if not f.get("fatal")}
    assert {"SIGKILL", "SIGSEGV", "missed_heartbeat"} <= causes, causes
    # the console showed the failed rank's log, prefixed
    assert "replica0-rank0 | " in out or "replica1-rank0 | " in out


def _explain(run: Path, recs: list[dict], out: str) -> str:
    """Every recovery, failure and step abort in full, then the console's tail: what a reader
    of a CI log needs to tell an unplanned recovery's cause (pytest shortens a plain repr)."""
    lines = ["recoveries:"] + [f"  {json.dumps(r, default=str)}" for r in recs]
    lines += ["failures:"] + [f"  {json.dumps(f, default=str)}" for f in events(run, "failure")]
    aborts = events(run, "step.abort")
    lines += [f"step aborts: {len(aborts)}; the last ten:"]
    lines += [f"  {json.dumps(a, default=str)}" for a in aborts[-10:]]
    return "\n".join([*lines, "console (tail):", out[-6000:]])


@pytest.mark.timeout(300)
def test_unmodified_program_takes_in_process_faults_through_the_opt_in_hook(tmp_path):
    """With ``program.hooks``, a GIL held in a C call (the group stops asking for quorums: hung,
    killed, restarted) and an aborted collective (the step aborts, the group goes on without a
    restart) reach a program that was not changed for them."""
    _write_experiment(
        tmp_path / "exp.toml",
        "tree",
        {
            "seed =": "seed = 6",
            "mix =": "mix = { gil_deadlock = 1, collective_abort = 1 }",
            "at_steps =": "at_steps = [60, 200]",
            "start_timeout_s =": "start_timeout_s = 90.0\nhooks = true",
        },
    )
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    run = tmp_path / "run" / "in_place"
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    recs = fault_recoveries(run, report["summary"]["policies"]["in_place"]["recoveries"])
    assert sorted(r["kind"] for r in recs) == ["collective_abort", "gil_deadlock"], (
        recs,
        out[-4000:],
    )
    assert all(r["participate_s"] is not None for r in recs), recs
    failures = [f for f in events(run, "failure") if not f.get("fatal")]
    # the held GIL is a hang; the aborted collective fails a step, not the process
    assert [f["cause"] for f in failures] == ["missed_heartbeat"], (failures, out[-4000:])
    assert any(
        a["reason"].startswith("asked for a quorum again") for a in events(run, "step.abort")
    )


@pytest.mark.timeout(180)
def test_program_without_the_launcher_environment_fails_and_shows_its_log(tmp_path):
    """The program refuses to run without TORCHFT_LIGHTHOUSE (``env -u`` removes what
    ftharness gives it): each start is a failure with its exit code, the console shows the
    log's tail prefixed by the rank, and past the restart intensity the job fails."""
    command = ["env", "-u", "TORCHFT_LIGHTHOUSE", sys.executable, str(PROGRAM), "5"]
    out_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out", str(out_dir),
            "--set", "replicas=1", "--set", "recovery.max_restarts=1",
            "--set", f"program.command={json.dumps(command)}",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "replica0-rank0 | train_ddp: missing environment TORCHFT_LIGHTHOUSE" in out, out[-3000:]
    failures = [f for f in events(out_dir, "failure") if not f.get("fatal")]
    assert len(failures) == 2 and all(f["exit_code"] == 2 for f in failures), failures
    log = (out_dir / "logs" / "replica0-rank0.log").read_text()
    assert log.count("missing environment TORCHFT_LIGHTHOUSE") == 2
