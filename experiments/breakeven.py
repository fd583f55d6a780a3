"""When does in-place recovery pay for its fault-free cost? A break-even model, from figures.

``python -m experiments.breakeven [--json]`` prints, per scenario, the fraction of a job's time
lost to fault tolerance and failures under ftharness's in-place recovery and under plain
checkpoint-and-restart, for a failure every M minutes, and the failure interval above which
plain restart wins. The model (per failure of the whole job, failures far enough apart that
recoveries do not overlap):

* **in place**: every step costs ``step_ratio`` times a plain step (``bench overhead``), so the
  steady state loses ``1 - 1/step_ratio`` of the time; each failure stalls every group for
  ``stall_s`` and takes one group of ``groups`` out for ``back_s`` (``bench recovery``), so it
  loses ``stall_s + back_s / groups`` of job time.
* **checkpoint and restart**: no steady-state cost (checkpoint saves assumed asynchronous and
  free); each failure loses ``restart_s`` (the whole job back to training) plus, on average,
  half a checkpoint interval of work redone.
* **break-even**: the failure interval M* at which both lose the same; plain restart wins for
  failures rarer than that: M* = (restart_s + interval/2 - stall_s - back_s/groups) /
  (1 - 1/step_ratio).

Each scenario says which of its figures were measured on this machine (and by which command)
and which are assumptions. The figures are data, not code: pass ``--scenario NAME=JSON`` to
price your own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class Scenario:
    name: str
    groups: int
    step_ratio: float  # ftharness fault-free step time / plain (CPU per step)
    stall_s: float  # survivor stall per failure, in place
    back_s: float  # failed group back to participating, in place
    restart_s: float  # checkpoint-and-restart: failure -> whole job training again
    checkpoint_interval_s: float
    measured: tuple[str, ...] = ()
    assumed: tuple[str, ...] = field(default=())


def lost_in_place(s: Scenario, mtbf_s: float) -> float:
    """Fraction of time lost in place with a failure every ``mtbf_s``."""
    steady = 1.0 - 1.0 / s.step_ratio
    return min(1.0, steady + (s.stall_s + s.back_s / s.groups) / mtbf_s)


def lost_restart(s: Scenario, mtbf_s: float) -> float:
    """Fraction of time lost by checkpoint-and-restart with a failure every ``mtbf_s``."""
    return min(1.0, (s.restart_s + s.checkpoint_interval_s / 2.0) / mtbf_s)


def break_even_s(s: Scenario) -> float:
    """The failure interval above which plain restart loses less (inf: in place always wins,
    0: it never does)."""
    saved = s.restart_s + s.checkpoint_interval_s / 2.0 - s.stall_s - s.back_s / s.groups
    steady = 1.0 - 1.0 / s.step_ratio
    if saved <= 0:
        return 0.0
    return math.inf if steady <= 0 else saved / steady


#: The pretraining rows: assumed figures around llama3 debug's measured step ratio.
PRETRAINING = Scenario(
    "pretraining, 64 groups",
    groups=64,
    step_ratio=1.025,
    stall_s=5.0,
    back_s=120.0,
    restart_s=600.0,
    checkpoint_interval_s=1800.0,
    measured=("step_ratio: llama3 debug's, bench overhead",),
    assumed=(
        "stall_s 5 s, back_s 120 s (process start and a heal of a large model over the network)",
        "restart_s 600 s (requeue, node allocation, checkpoint load), checkpoint every 30 min",
    ),
)

#: Figures from README "Measured here": bench overhead (CPU per step vs plain), bench recovery.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "tiny model, 3 groups (this machine)",
        groups=3,
        step_ratio=1.26,
        stall_s=0.041,
        back_s=0.139,
        restart_s=3.02,
        checkpoint_interval_s=0.5,
        measured=(
            "step_ratio: bench overhead, default (tree quorum, sparse)",
            "stall_s, back_s (tree quorum), restart_s: bench recovery --quick",
        ),
        assumed=("checkpoint_interval_s: 10 steps of ~0.05 s",),
    ),
    Scenario(
        "llama3 debug, 3 groups (this machine)",
        groups=3,
        step_ratio=1.025,
        stall_s=0.25,
        back_s=2.15,
        restart_s=14.0,
        checkpoint_interval_s=9.2,
        measured=(
            "step_ratio: bench overhead",
            "stall_s, back_s, restart_s: bench recovery",
            "checkpoint_interval_s: 10 steps of 0.92 s",
        ),
    ),
    PRETRAINING,
    replace(PRETRAINING, name="pretraining, 1024 groups", groups=1024),
)
MTBF_MIN: tuple[float, ...] = (1, 14, 60, 180, 720)


def table(scenarios: Sequence[Scenario], mtbf_min: Sequence[float]) -> list[dict]:
    rows = []
    for s in scenarios:
        rows.append(
            {
                **asdict(s),
                "lost": {
                    str(m): {
                        "in_place": round(lost_in_place(s, m * 60), 4),
                        "restart": round(lost_restart(s, m * 60), 4),
                    }
                    for m in mtbf_min
                },
                "break_even_min": round(break_even_s(s) / 60, 2),
            }
        )
    return rows


def markdown(rows: Sequence[dict], mtbf_min: Sequence[float]) -> str:
    head = " | ".join(f"M = {m:g} min" for m in mtbf_min)
    lines = [
        f"| scenario | {head} | restart wins for failures rarer than |",
        "|---" * (len(mtbf_min) + 2) + "|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{100 * v['in_place']:.1f} % vs {100 * v['restart']:.1f} %" for v in r["lost"].values()
        )
        lines.append(f"| {r['name']} | {cells} | {r['break_even_min']:g} min |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.breakeven",
        description="Time lost in place vs checkpoint-and-restart (model: see the module).",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='an extra scenario, e.g. mine={"groups":8,"step_ratio":1.02,"stall_s":1,'
        '"back_s":30,"restart_s":300,"checkpoint_interval_s":900}',
    )
    ap.add_argument("--mtbf-min", type=float, nargs="+", default=list(MTBF_MIN))
    args = ap.parse_args(argv)
    scenarios = list(SCENARIOS)
    for text in args.scenario:
        name, _, body = text.partition("=")
        try:
            scenarios.append(Scenario(name, **json.loads(body)))
        except (TypeError, ValueError) as e:
            print(f"--scenario {text!r}: {e}", file=sys.stderr)
            return 2
    rows = table(scenarios, args.mtbf_min)
    if not args.json:
        print("fraction of time lost, in place vs checkpoint-and-restart, a failure every M min")
        print(markdown(rows, args.mtbf_min))
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
