"""``ftharness bench slurm_takeover``: the controller's node of a SLURM job lost, the run goes on.

On the test cluster (``bin/test-cluster up 3``, ``SLURM_CONF`` set; root), ``reps`` times: a job
of 3 nodes submitted with ``ftharness slurm submit`` and ``slurm.controller_node = "reserved"``
(the first node runs the keeper and the controller only; two groups train on the other two, the
keeper's standby waits on the last). Once it has committed 60 steps, the first node fails
(``runtime.launchers.slurm_testcluster.fail_node``: its slurmd and every process on it killed);
the standby takes the run over (``harness.keeper.standby_node``) and the run trains to its last
step. Figures per crash, and their median and max:

* ``no_commit_s``: the longest time with no committed step across the node's death (from the
  last commit before it to the first after);
* ``serving_s``: the node's death -> the new controller serving (its ``replacement_started``);
* ``groups_restarted``, ``steps_lost`` (a step a group committed twice), ``replicas_equal``
  (every step both groups committed has one checksum), ``ok`` (the run ended ``ok`` at its last
  step and the standby ended the allocation).

The node is revived after each rep (``bin/test-cluster revive``), and waited for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.bench.slurm_requeue import _wait
from runtime.journal import read_journal
from runtime.launchers import slurm, slurm_testcluster

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_AT = 400, 60


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "journal.jsonl"
    return read_journal(path) if path.exists() else []


def _commits(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "step.commit"]


def one(workdir: Path, log: Any) -> dict[str, Any]:
    """One job, its first node failed at step ``KILL_AT``; its figures."""
    config = workdir / "job.toml"
    text = (ROOT / "experiments" / "tiny.toml").read_text()
    text = text.replace("replicas = 3", "replicas = 2").replace("steps = 200", f"steps = {STEPS}")
    text = text.replace('name = "tiny"', 'name = "slurm-takeover"')
    config.write_text(text + '\n[slurm]\ncontroller_node = "reserved"\n')
    run = workdir / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "slurm", "submit", str(config), "--nodes", "3",
         "--out", str(run), "--", "--time=10"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    job_id = json.loads((run / "slurm.json").read_text())["job_id"]
    inner = run / "run"
    try:
        if not _wait(lambda: len(_commits(_records(inner))) >= KILL_AT, 180):
            raise RuntimeError(f"job {job_id} did not train: {list(run.glob('slurm-*.out'))}")
        first = slurm.job_nodes(job_id)[0]
        t0 = time.time()
        slurm_testcluster.fail_node(first)
        log(f"job {job_id}: failed {first}")
        ended = _wait(lambda: slurm.job_state(job_id) in ("CANCELLED", "COMPLETED", None), 240)
        records = _records(inner)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
        subprocess.run([str(ROOT / "bin" / "test-cluster"), "revive", first], timeout=120)
        _wait(lambda: slurm.node_states([first]).get(first) == "idle", 60, poll=1.0)
    commits = _commits(records)
    times = sorted(r["t"] for r in commits)
    before = max((t for t in times if t <= t0), default=t0)
    after = min((t for t in times if t > t0), default=None)
    serving = [
        r["t"]
        for r in records
        if r["event"] == "recovery.phase"
        and r.get("cause") == "controller_crash"
        and r.get("phase") == "replacement_started"
        and r["t"] > t0
    ]
    end = [r for r in records if r["event"] == "job.end"]
    by_step: dict[int, set[str]] = {}
    lost = 0
    for replica in sorted({r["replica"] for r in commits}):
        steps = [r["step"] for r in commits if r["replica"] == replica]
        lost += len(steps) - len(set(steps))
    for r in commits:
        if r.get("checksum"):
            by_step.setdefault(r["step"], set()).add(str(r["checksum"]))
    starts = [r for r in records if r["event"] == "group.start"]
    return {
        "job_id": job_id,
        "no_commit_s": round(after - before, 3) if after is not None else None,
        "serving_s": round(serving[0] - t0, 3) if serving else None,
        "groups_restarted": len(starts) - len({r["replica"] for r in starts}),
        "steps_lost": lost,
        "replicas_equal": all(len(v) == 1 for v in by_step.values()),
        "ok": bool(ended and end and end[-1]["status"] == "ok" and end[-1]["steps"] >= STEPS),
    }


def main(args: argparse.Namespace) -> int:
    ok, why = slurm.available()
    if not ok:
        print(f"ftharness bench slurm_takeover: {why}", file=sys.stderr)
        return 2
    reps = args.reps or (1 if args.quick else 5)

    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench slurm_takeover] {msg}", file=sys.stderr, flush=True)

    runs = []
    for k in range(reps):
        with tempfile.TemporaryDirectory(prefix="ftharness-slurm-takeover-", dir="/tmp") as tmp:
            runs.append(one(Path(tmp), log))
        log(f"{k + 1}/{reps}: {runs[-1]}")
    gaps = [r["no_commit_s"] for r in runs if r["no_commit_s"] is not None]
    serving = [r["serving_s"] for r in runs if r["serving_s"] is not None]
    result = {
        "bench": "slurm_takeover",
        "reps": reps,
        "no_commit_s_median": round(statistics.median(gaps), 3) if gaps else None,
        "no_commit_s_max": max(gaps) if gaps else None,
        "serving_s_median": round(statistics.median(serving), 3) if serving else None,
        "serving_s_max": max(serving) if serving else None,
        "groups_restarted": sum(r["groups_restarted"] for r in runs),
        "steps_lost": sum(r["steps_lost"] for r in runs),
        "replicas_equal": all(r["replicas_equal"] for r in runs),
        "all_ok": all(r["ok"] for r in runs),
        "runs": runs,
    }
    print(json.dumps(result))
    return 0
