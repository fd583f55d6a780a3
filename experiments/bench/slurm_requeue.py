"""``ftharness bench slurm_requeue``: the baseline for SLURM node loss — a whole-job requeue.

The classic SLURM job (``ftharness slurm submit --requeue``: no ``--no-kill``, no spare nodes)
on the test cluster (``bin/test-cluster up 3``, ``SLURM_CONF`` set; root): once it trains, its
second node fails (``runtime.launchers.slurm_testcluster.fail_node``: slurmd and every
process of the node). SLURM notices after ``SlurmdTimeout``, ends the job with ``NODE_FAIL``,
requeues it, and runs the batch script again on the nodes left; the new run resumes from the
last checkpoint. Figures:

* ``requeue_participate_s``: node death -> the requeued run's first committed step (what
  ``participate_s`` is for a spare-node recovery, experiments/slurm_node_loss.toml);
* ``node_down_s``: node death -> SLURM shows it not responding or down (first ``sinfo`` poll);
* ``requeued_start_s``: node death -> the requeued run's ``job.start``;
* ``first_run_ended_s``: node death -> the first run's last commit (it trains on without the
  node until SLURM ends the job);
* ``steps_lost``: steps the first run committed past the checkpoint the requeued run resumed
  from (trained again).

One repetition (a requeue takes minutes); the job is cancelled at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.slurm_submit import job_state
from runtime.journal import read_journal
from runtime.launchers import slurm, slurm_testcluster

ROOT = Path(__file__).resolve().parents[2]


def _events(run: Path, event: str) -> list[dict[str, Any]]:
    path = run / "journal.jsonl"
    if not path.exists():
        return []
    return [r for r in read_journal(path) if r.get("event") == event]


def _wait(cond: Any, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return False


def measure(workdir: Path, timeout_s: float, log: Any) -> dict[str, Any]:
    config = workdir / "job.toml"
    text = (ROOT / "experiments" / "tiny.toml").read_text()
    text = text.replace("replicas = 3", "replicas = 2").replace("steps = 200", "steps = 1000000")
    text = text.replace("every_steps = 50", "every_steps = 25")
    text = text.replace('name = "tiny"', 'name = "requeue"')
    config.write_text(text)
    run = workdir / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "slurm", "submit", str(config), "--nodes", "2",
         "--requeue", "--out", str(run), "--", "--time=15"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    job_id = json.loads((run / "slurm.json").read_text())["job_id"]
    try:
        first = run / "run-0"
        if not _wait(lambda: len(_events(first, "checkpoint.save")) >= 2, timeout_s):
            raise RuntimeError(f"job {job_id} did not train: {list(run.glob('slurm-*.out'))}")
        nodes = slurm.job_nodes(job_id)
        victim = nodes[-1]  # not the first node: the batch script (the controller) runs there
        log(f"job {job_id} on {nodes}: failing {victim}")
        t0 = time.time()
        slurm_testcluster.fail_node(victim)
        down: list[float] = []

        def node_down() -> bool:
            if not down and slurm.unusable(slurm.node_states([victim]).get(victim, "unknown")):
                down.append(time.time() - t0)
            return bool(down)

        _wait(node_down, 120, poll=0.5)
        second = run / "run-1"
        ok = _wait(lambda: bool(_events(second, "step.commit")), timeout_s, poll=0.5)
        if not ok:
            raise RuntimeError(f"the requeued job {job_id} did not train ({job_state(job_id)})")
        # the first run trained on (its lost group restarted on the node left) until SLURM
        # ended the job: everything it committed past the checkpoint is trained again
        trained = [r["step"] for r in _events(first, "step.commit")]
        resumed = [r["step"] for r in _events(second, "checkpoint.load")]
        commits = _events(second, "step.commit")
        end = _events(first, "step.commit")[-1]["t"] if trained else t0
        return {
            "job_id": job_id,
            "failed_node": victim,
            "node_down_s": round(down[0], 2) if down else None,
            "requeued_start_s": round(_events(second, "job.start")[0]["t"] - t0, 2),
            "requeue_participate_s": round(min(r["t"] for r in commits) - t0, 2),
            "first_run_ended_s": round(end - t0, 2),
            "resumed_from_step": max(resumed) if resumed else 0,
            "steps_lost": max(trained) - (max(resumed) if resumed else 0) if trained else None,
        }
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


def main(args: argparse.Namespace) -> int:
    ok, why = slurm.available()
    if not ok:
        print(f"ftharness bench slurm_requeue: {why}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench slurm_requeue] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ftharness-requeue-", dir="/tmp") as tmp:
        result = measure(Path(tmp), 400.0, log)
    print(json.dumps(result))
    return 0
