"""``ftharness bench takeover``: the controller SIGKILLed mid-run, again and again, and a new
one taking over (``harness.job.takeover``, ``docs/controller.md``).

One ``ftharness run`` of the tiny job (3 groups, tree quorum, in place) under its keeper, in a
process of its own as a user starts it. Every ``interval`` committed steps (300 by default: about
6 s here, time for the keeper's standby controller to be ready again) the bench SIGKILLs the
serving controller (its pid from ``RUN/controller.json``), ``reps`` times; the keeper hands the
run to its standby (or starts a new controller) each time and the run goes on to its last step.
From the journal:

* ``no_commit_s``: per crash, the longest time without a committed step from the last commit
  before the kill to the next kill (the stall comes when the trainers next need a quorum, not
  at the kill itself), p50/p95/max;
* ``serving_s``: per crash, from the kill to the new controller serving (its recovery's
  ``replacement_started``);
* ``workers_restarted``: trainer processes started after the first kill (0: every group was
  adopted, none restarted);
* ``steps_back``: commits after a takeover whose step is not above every step committed before
  the kill by that group (0: no committed step lost);
* ``replicas_equal``: the groups' weight checksums at the last sampled step are equal;
* ``rc``: the run's exit status (0: it reached its last step).

The last line printed is a JSON object.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from runtime.journal import PROC_START, RECOVERY_PHASE, STEP_COMMIT, read_journal

DEFAULT_REPS = 10
STEP_S = 0.05  # the tiny job's step time here, roughly: sizes the run to the crashes


def _controller(run_dir: Path) -> tuple[int, int] | None:
    """(pid, epoch) of the serving controller, from its control file."""
    try:
        info = json.loads((run_dir / "controller.json").read_text())
        return int(info["pid"]), int(info["epoch"])
    except (OSError, ValueError, KeyError):
        return None


def _committed(run_dir: Path) -> int:
    path = run_dir / "journal.jsonl"
    if not path.exists():
        return 0
    steps = [int(r["step"]) for r in read_journal(path) if r["event"] == STEP_COMMIT]
    return max(steps, default=0)


def run(
    reps: int,
    interval: int = 300,
    out: Path | None = None,
    overrides: tuple[str, ...] = (),
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run the job with ``reps`` controller crashes ``interval`` steps apart; the figures
    above. ``out``: the run directory (a fresh temporary one by default)."""
    out = out or Path(tempfile.mkdtemp(prefix="ftharness-takeover-")) / "run"
    steps = interval * (reps + 2)
    argv = [
        sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out", str(out),
        "--quiet",
        *(f"--set={o}" for o in (f"steps={steps}", "replicas=3", "checkpoint.every_steps=0",
                                 *overrides)),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kills: list[tuple[float, int]] = []  # (time, epoch killed)
    deadline = time.monotonic() + timeout_s
    try:
        for k in range(reps):
            target = interval * (k + 1)
            while _committed(out) < target or (_controller(out) or (0, 0))[1] <= k:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the run ended or stalled before crash {k + 1}")
                time.sleep(0.05)
            pid, epoch = _controller(out) or (0, 0)
            kills.append((time.time(), epoch))
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        proc.kill()
        output = proc.communicate()[0]
        raise
    result = measure(out, [t for t, _ in kills])
    result.update(rc=proc.returncode, crashes=len(kills), steps=steps, run_dir=str(out))
    if proc.returncode != 0:
        result["output_tail"] = output[-2000:]
    return result


def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p95": None, "max": None}
    s = sorted(xs)
    return {
        "p50": round(statistics.median(s), 3),
        "p95": round(s[min(len(s) - 1, round(0.95 * (len(s) - 1)))], 3),
        "max": round(s[-1], 3),
    }


def measure(run_dir: Path, kills: list[float]) -> dict[str, Any]:
    """The figures of the module doc, from ``run_dir``'s journal and the kill times."""
    records = read_journal(run_dir / "journal.jsonl")
    commits = [r for r in records if r["event"] == STEP_COMMIT and r.get("rank", 0) == 0]
    times = sorted(float(r["t"]) for r in commits)
    gaps, serving = [], []
    ends = [*kills[1:], float("inf")]
    for t_kill, t_next in zip(kills, ends, strict=True):
        # From the last commit before the kill to the next kill: the stall may come later than
        # the kill (trainers commit on their own until they next need a quorum).
        before = [t for t in times if t <= t_kill]
        window = before[-1:] + [t for t in times if t_kill < t <= t_next]
        if len(window) > 1:
            gaps.append(max(b - a for a, b in itertools.pairwise(window)))
        served = [
            float(r["t"])
            for r in records
            if r["event"] == RECOVERY_PHASE
            and r.get("cause") == "controller_crash"
            and r.get("phase") == "replacement_started"
            and float(r["t"]) > t_kill
        ]
        if served:
            serving.append(min(served) - t_kill)
    first = min(kills, default=float("inf"))
    restarted = [
        r
        for r in records
        if r["event"] == PROC_START and r.get("replica") is not None and float(r["t"]) > first
    ]
    back = 0
    for t_kill in kills:
        for replica in {r.get("replica") for r in commits}:
            mine = [r for r in commits if r.get("replica") == replica]
            high = max((int(r["step"]) for r in mine if float(r["t"]) <= t_kill), default=0)
            later = [int(r["step"]) for r in mine if float(r["t"]) > t_kill]
            back += sum(1 for s in later[:1] if s <= high)
    sums: dict[int, dict[Any, str]] = {}
    for r in commits:
        if r.get("checksum"):
            sums.setdefault(int(r["step"]), {})[r.get("replica")] = r["checksum"]
    last = max((s for s, by in sums.items() if len(by) > 1), default=None)
    equal = last is not None and len(set(sums[last].values())) == 1
    return {
        "no_commit_s": _stats(gaps),
        "serving_s": _stats(serving),
        "workers_restarted": len(restarted),
        "steps_back": back,
        "replicas_equal": equal,
        "checksum_step": last,
    }


def main(args: Namespace) -> int:
    """Entry point for ``ftharness bench takeover [--json] [--reps N] [--quick]``."""
    quick = bool(getattr(args, "quick", False))
    reps = args.reps or (3 if quick else DEFAULT_REPS)
    result = run(reps)
    if not getattr(args, "json", False):
        print(
            f"{result['crashes']} controller crashes, rc {result['rc']}: "
            f"no commit p50 {result['no_commit_s']['p50']} s p95 {result['no_commit_s']['p95']} "
            f"s; new controller serving p50 {result['serving_s']['p50']} s; workers restarted "
            f"{result['workers_restarted']}, steps back {result['steps_back']}, replicas equal "
            f"{result['replicas_equal']}"
        )
    print(json.dumps(result))
    return 0 if result["rc"] == 0 else 1
