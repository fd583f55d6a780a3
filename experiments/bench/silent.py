"""Silent failures, measured: ``python -m experiments.bench.silent [--hold S]`` (JSON last line).

Tiny model, 3 replica groups x 1 rank, this machine. Two parts, computed from the journals:

* **bitflip**: one bit of a group's weights flipped (the real ``bitflip`` fault) at step 12 in
  group 0 and at step 41 in group 2. Per flip: detection latency in committed steps and seconds,
  heal time after detection (the suspect's ``healed`` phase), steps the suspect committed after
  detection, heals that could have come from the corrupted group (``heals_while_corrupted``,
  experiments.report_silent), and whether the replicas end bitwise equal.
* **straggler**: one group slowed 3x (``slow_rank`` with ``delay_s`` = twice the job's wall
  time per step measured in the control run) for ``--hold`` seconds, under
  ``recovery.stragglers.policy`` ``observe`` and ``eject``, against a fault-free control run of
  the same length. Committed samples/s (every group's commits) during the fault window, the
  ratio to the control's over the same window after start, the time from the fault to the
  ejection, and whether the ejected group committed again.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.report_silent import silent_summary
from faults.fault import Target, make_fault
from harness.config import load_config
from runtime.journal import FAULT_INJECT, STEP_COMMIT, STRAGGLER, read_journal

TINY = "experiments/tiny.toml"


def _wait_step(job: Any, step: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while job.faults.committed_step() < step and time.monotonic() < deadline:
        time.sleep(0.02)


def bitflips(root: Path) -> dict[str, Any]:
    from harness.job.launch import run_job

    cfg = load_config(
        TINY, ["steps=80", "checkpoint.every_steps=0", "recovery.quorum_every_steps=1"]
    )
    flip = make_fault("bitflip", where="weights", bit=22)

    def started(job: Any) -> None:
        def go() -> None:
            for replica, step in ((0, 12), (2, 41)):
                _wait_step(job, step)
                flip.fire(job.faults, Target(replica=replica, rank=0), random.Random(replica))

        threading.Thread(target=go, daemon=True).start()

    out = run_job(cfg, root / "bitflip", quiet=True, on_started=started, timeout=150)
    recs = read_journal(root / "bitflip" / "journal.jsonl")
    divergences = silent_summary(recs).get("in_place", {}).get("divergences", [])
    last = max((d["step"] for d in divergences), default=0)
    sums: dict[int, set[str]] = {}
    for r in recs:
        if r["event"] == STEP_COMMIT and r.get("checksum") and r["step"] > last:
            sums.setdefault(r["step"], set()).add(r["checksum"])
    return {
        "status": out["status"],
        "divergences": divergences,
        "replicas_equal_at_end": bool(sums) and all(len(v) == 1 for v in sums.values()),
    }


def _samples_per_s(recs: list[dict[str, Any]], t0: float, t1: float) -> float:
    n = sum(
        int(r.get("samples") or 0) for r in recs if r["event"] == STEP_COMMIT and t0 <= r["t"] < t1
    )
    return n / max(t1 - t0, 1e-9)


def straggler(root: Path, hold_s: float, start_s: float, total_s: float) -> dict[str, Any]:
    from harness.job.launch import run_job

    rows: dict[str, Any] = {}
    delay = None
    for name in ("control", "observe", "eject"):
        policy = "eject" if name == "eject" else "observe"
        cfg = load_config(TINY, ["steps=1000000", f"recovery.stragglers.policy={policy}"])
        marks: dict[str, float] = {}

        def started(
            job: Any, name: str = name, marks: dict[str, float] = marks, delay: Any = delay
        ) -> None:
            marks["start"] = time.time()
            if name == "control":
                return
            slow = make_fault("slow_rank", delay_s=delay, hold_s=hold_s)
            target = Target(replica=1, rank=0)

            def go() -> None:
                time.sleep(start_s)
                marks["fault"] = time.time()
                slow.fire(job.faults, target, random.Random(0))
                time.sleep(hold_s)
                slow.heal(job.faults, target)
                marks["heal"] = time.time()

            threading.Thread(target=go, daemon=True).start()

        run_job(cfg, root / name, quiet=True, on_started=started, duration_s=total_s, timeout=300)
        recs = read_journal(root / name / "journal.jsonl")
        t_start = marks["start"]
        t_f = marks.get("fault", t_start + start_s)
        t_h = marks.get("heal", t_f + hold_s)
        row: dict[str, Any] = {"samples_per_s_during": round(_samples_per_s(recs, t_f, t_h), 1)}
        if name == "control":
            compute = [
                r["compute_s"]
                for r in recs
                if r["event"] == STEP_COMMIT and r.get("compute_s") is not None
            ]
            steps = {r["step"] for r in recs if r["event"] == STEP_COMMIT and t_f <= r["t"] < t_h}
            step_s = (t_h - t_f) / max(1, len(steps))  # the job's wall time per step
            delay = round(2 * step_s, 4)  # the slowed group's step: 3x the job's
            row["median_compute_s"] = round(statistics.median(compute), 4)
            row["step_s"] = round(step_s, 4)
            row["slow_rank_delay_s"] = delay
        else:
            fault_t = next((r["t"] for r in recs if r["event"] == FAULT_INJECT), t_f)
            events = [r for r in recs if r["event"] == STRAGGLER]
            row["straggler_events"] = [(e["action"], round(e["t"] - fault_t, 2)) for e in events]
            ejected = [e for e in events if e["action"] == "ejected"]
            row["ejected_after_s"] = round(ejected[0]["t"] - fault_t, 2) if ejected else None
            row["flagged_after_s"] = next(
                (round(e["t"] - fault_t, 2) for e in events if e["action"] == "flagged"), None
            )
            back = [
                r
                for r in recs
                if r["event"] == STEP_COMMIT
                and r["replica"] == 1
                and ejected
                and r["t"] > ejected[0]["t"]
            ]
            row["ejected_group_back_after_s"] = (
                round(back[0]["t"] - ejected[0]["t"], 2) if back else None
            )
        rows[name] = row
    control = rows["control"]["samples_per_s_during"]
    for name in ("observe", "eject"):
        rows[name]["vs_control"] = round(rows[name]["samples_per_s_during"] / control, 3)
    return rows


def measure(root: Path, hold_s: float, bitflip: bool = True) -> dict[str, Any]:
    """Both parts (``bitflip`` False: the straggler part only), runs kept under ``root``."""
    result: dict[str, Any] = {"runs": str(root)}
    if bitflip:
        result["bitflip"] = bitflips(root)
        print(json.dumps(result["bitflip"]), flush=True)
    start_s = 8.0
    result["straggler"] = straggler(root, hold_s, start_s, start_s + hold_s + 4.0)
    return result


def bench(args: argparse.Namespace) -> int:
    """Entry point for ``ftharness bench silent [--json] [--quick]`` (``--quick``: the group
    stays slow 8 s instead of 15)."""
    root = Path(tempfile.mkdtemp(prefix="ftharness-silent-"))
    print(json.dumps(measure(root, 8.0 if getattr(args, "quick", False) else 15.0)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", type=float, default=15.0, help="seconds the group stays slow")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp folder)")
    ap.add_argument("--skip-bitflip", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="ftharness-silent-"))
    print(json.dumps(measure(root, args.hold, not args.skip_bitflip)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
