"""``ftharness bench recovery``: what a SIGKILLed replica group costs, policy by policy.

3 replica groups x 1 rank. In each configuration one job runs and ``--reps`` (default 10;
3 with ``--quick``) times a random replica group (never the same twice in a row) is SIGKILLed
at a random step, once the previous recovery has finished and the job has trained a few steps
since. Configurations, all in the same run and on the same seed:

* ``in_place/torchft`` — in-place restart; membership by torchft's Lighthouse (heartbeats);
* ``in_place/tree``    — in-place restart; membership by the supervision tree (harness.quorum.tree),
  a quorum every 10 steps and whenever membership may change (the default, harness.rank.trainer);
* ``in_place/tree_every_step`` — the same with a quorum every step;
* ``full_restart``     — every process restarted, resume from the last checkpoint;
* ``sharded/tree``     — 3 groups x 2 ranks, the model sharded over each group's ranks with FSDP2
  (``parallel.group = "fsdp"``: HSDP), in place, tree quorum; a kill of rank 0 restarts its whole
  group, whose ranks heal their shards from a healthy group;
* ``replicated_2ranks/tree`` — the same 3 x 2 shape, the model whole in every rank.

``sharded_vs_unsharded`` (per model) divides the sharded row's median ``replacement_back_s`` by
the unsharded rows' (goal: at most 1.5x) and repeats its stall (goal: p50 <= 0.1 s, p95 <= 0.3 s),
also in the survivors' own steps (``stall_p50_steps``: see ``survivor_stall_steps``).

Figures per configuration (median, p95, min, max over the kills; p95 is linear-interpolated,
so with 10 kills it lies between the two slowest), computed from the journal by
``dashboards.metrics`` (its docstring has the definitions): ``survivor_stall_s``;
``survivor_stall_steps``, each recovery's stall in its stalled survivor's typical gaps between
commits (how many of its own steps a survivor loses: the figure that carries to a machine whose
steps are shorter or longer); ``replacement_back_s`` (kill -> the killed group commits again),
``steps_lost``; for full_restart also ``full_restart_back_s`` (kill -> the job commits its next
step); and ``weights_match`` (every step committed by several groups has one checksum, per
incarnation);
``phases_s``: for each recovery phase (detected, replacement_started, healed, participating),
the median time from the kill to it: where the replacement's time goes; ``start_s``: the median
seconds of a replacement's trainer construction and of each of its parts (``trainer.start``
records after the first kill, every rank: ``runtime.journal``).
A second row set runs the llama3 debug model (not with ``--quick``).

More configurations run a program of the user's own instead of the built-in trainer
(``tests/programs/train_ddp.py``, a plain torchft program; ``harness.job.program.groups``),
under each quorum backend, started cold (a fresh interpreter: ``program/torchft``,
``program/tree``) and warm (``program.warm``: a fork of the agent's preloaded interpreter,
``program_warm/...``), and
the semi-synchronous ``train_diloco.py`` and ``train_localsgd.py`` (a sync every
:data:`SYNC_EVERY` inner steps, warm: ``program_diloco/...``, ``program_localsgd/...``; their
steps are inner steps), and a sharded one, ``train_hsdp.py`` (FSDP2 over each group's ranks,
torchft across groups, a synchronous quorum; 2 groups x 2 ranks, warm: ``program_hsdp/tree``;
its ``weights_match``: every group's rank r printed the same shard checksum at each step). Every
program runs with torchft's default 60 s process-group timeout, and
program rows kill ``--reps`` times, else 10 (even with ``--quick``: p95 needs them).
Their figures come from what the quorum tap observed (commits one request late, see
``harness.job.program.groups``), plus ``cold_start_to_first_commit_s``: from the program's first
start to its group's first committed step, per group (same machine, same run). ``vs_builtin``
compares each program row's ``replacement_back_s`` to the cold row's cold start under the same
backend (the same program from a cold start; goal: at most 1.5x) and its ``survivor_stall_s`` to the
built-in trainer's under the same backend (goal: within 1.2x).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dashboards.metrics import percentile, summarize
from experiments.bench.models import MODELS
from experiments.report import evaluate_hypotheses
from experiments.spec import Hypotheses
from harness.config import load_config
from harness.job.launch import run_job
from runtime.journal import FAULT_INJECT, JOB_RESTART, STEP_COMMIT, TRAINER_START, read_journal

CONFIGS = {
    "in_place/torchft": ["recovery.policy=in_place", "recovery.quorum=torchft"],
    "in_place/tree": ["recovery.policy=in_place", "recovery.quorum=tree"],
    "in_place/tree_every_step": [
        "recovery.policy=in_place",
        "recovery.quorum=tree",
        "recovery.quorum_every_steps=1",
    ],
    "full_restart": ["recovery.policy=full_restart", "recovery.quorum=torchft"],
    # 3 groups x 2 ranks, the model sharded over each group's ranks (FSDP2, HSDP with torchft),
    # against the same shape replicated: what sharding costs a recovery, side by side
    "sharded/tree": [
        "ranks=2",
        "parallel.group=fsdp",
        "recovery.policy=in_place",
        "recovery.quorum=tree",
    ],
    "replicated_2ranks/tree": [
        "ranks=2",
        "parallel.group=replicate",
        "recovery.policy=in_place",
        "recovery.quorum=tree",
    ],
}
#: A program of the user's own (harness.job.program.groups), run from a source checkout.
PROGRAMS = Path(__file__).resolve().parents[2] / "tests" / "programs"
PROGRAM = PROGRAMS / "train_ddp.py"
#: The programs' trailing arguments: no extra time per step, and torchft's default 60 s
#: process-group timeout (not a shortened one: a survivor left blocked would show it in full).
PROGRAM_ARGS = '"0", "60"'
#: The semi-synchronous programs' inner steps per sync (program.sync_every).
SYNC_EVERY = 10
PROGRAM_CONFIGS = (
    {
        f"program{'_warm' if warm else ''}/{quorum}": [
            "recovery.policy=in_place",
            f"recovery.quorum={quorum}",
            f'program.command=["python", "{PROGRAM}", "1000000", {PROGRAM_ARGS}]',
            "program.progress_timeout_s=30",
            f"program.warm={str(warm).lower()}",
        ]
        for warm in (False, True)
        for quorum in ("torchft", "tree")
    }
    | {
        f"program_{name}/{quorum}": [  # semi-synchronous, warm (the default)
            "recovery.policy=in_place",
            f"recovery.quorum={quorum}",
            f'program.command=["python", "{PROGRAMS / f"train_{name}.py"}", "1000000", '
            f'"{SYNC_EVERY}", {PROGRAM_ARGS}]',
            f"program.sync_every={SYNC_EVERY}",
            "program.progress_timeout_s=30",
        ]
        for name in ("diloco", "localsgd")
        for quorum in ("torchft", "tree")
    }
    | {
        # a sharded program: FSDP2 over each group's 2 ranks, torchft across 2 groups (warm)
        "program_hsdp/tree": [
            "replicas=2",
            "ranks=2",
            "recovery.policy=in_place",
            "recovery.quorum=tree",
            f'program.command=["python", "{PROGRAMS / "train_hsdp.py"}", "1000000", '
            f"{PROGRAM_ARGS}]",
            "program.progress_timeout_s=30",
        ],
    }
)


def _stall_steps(rec: dict[str, Any]) -> float | None:
    """A recovery's stall in its most stalled survivor's typical gaps (module doc)."""
    gaps = [g for g in rec.get("survivor_gaps") or () if g.get("typical_gap_s")]
    if not gaps:
        return None
    worst = max(gaps, key=lambda g: g["stall_s"])
    return worst["stall_s"] / worst["typical_gap_s"]


def _stats(xs: list[float | None]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {
        "median": round(statistics.median(xs), 3),
        "p95": round(percentile(xs, 95), 3),  # type: ignore[arg-type]  # xs is not empty
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
    }


def _killer(job: Any, reps: int, seed: int, done: threading.Event, log: Any) -> None:
    """Kill a group ``reps`` times, each after the last recovery finished plus 5-15 steps (quorum
    steps: a semi-synchronous program's journal counts ``program.sync_every`` inner steps each)."""
    from faults.fault import Target

    ctx = job.faults
    rng = random.Random(seed)
    per = job.cfg.program.steps_per_quorum
    last = None
    for i in range(reps):
        gap = rng.randint(5, 15) * per
        target_step = ctx.committed_step() + gap
        deadline = time.monotonic() + 180
        while (
            (ctx.committed_step() < target_step or job.tracker.open_count)
            and time.monotonic() < deadline
            and not done.is_set()
        ):
            time.sleep(0.02)
        if done.is_set():
            return
        replica = rng.choice([r for r in range(job.replicas) if r != last])
        last = replica
        pids = ctx.pids(Target(replica=replica, rank=0))
        if not pids:
            continue
        job.journal.emit(
            FAULT_INJECT,
            fault_id=f"k{i}",
            kind="kill",
            target={"replica": replica, "rank": 0, "host": ctx.replica_host(replica)},
            seed=seed,
            step=ctx.committed_step(),
        )
        os.kill(pids[0], signal.SIGKILL)
        log(f"kill {i + 1}/{reps}: replica {replica} at step {ctx.committed_step()}")
        # the next kill waits for this recovery: let it open first (a sync can be quicker)
        deadline = time.monotonic() + 2.0
        while not job.tracker.open_count and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.005)
    # let the last recovery finish and a few steps commit
    target_step = ctx.committed_step() + 5
    deadline = time.monotonic() + 120
    while (
        ctx.committed_step() < target_step or job.tracker.open_count
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    done.set()


def run_config(
    model: str, name: str, reps: int, seed: int, workdir: Path, log: Any
) -> dict[str, Any]:
    overrides = [
        "replicas=3",
        "ranks=1",
        "hosts=1",
        "steps=1000000",
        "checkpoint.every_steps=10",
        f"data.seed={seed}",
        *MODELS[model],
        *(CONFIGS.get(name) or PROGRAM_CONFIGS[name]),
    ]
    cfg = load_config(
        "experiments/tiny.toml" if Path("experiments/tiny.toml").exists() else _packaged_tiny(),
        overrides,
    )
    run_dir = workdir / model / name.replace("/", "_")
    done = threading.Event()

    def started(job: Any) -> Any:
        threading.Thread(target=_killer, args=(job, reps, seed, done, log), daemon=True).start()

    t0 = time.monotonic()
    outcome = run_job(cfg, run_dir, quiet=True, on_started=started, timeout=900, stop_event=done)
    records = read_journal(run_dir / "journal.jsonl")
    policy = cfg.recovery.policy
    summary = summarize(records)["policies"].get(policy, {})
    recs = summary.get("recoveries", [])
    row: dict[str, Any] = {
        "kills": len([r for r in records if r["event"] == FAULT_INJECT]),
        "recovered": len([r for r in recs if r.get("participate_s") is not None]),
        "survivor_stall_s": _stats([r.get("stall_s") for r in recs]),
        "survivor_stall_steps": _stats([_stall_steps(r) for r in recs]),
        "replacement_back_s": _stats([r.get("participate_s") for r in recs]),
        "steps_lost": _stats([r.get("steps_lost") for r in recs]),
        "step_time_s": _step_time(records),
        "status": outcome.get("status"),
        "seconds": round(time.monotonic() - t0, 1),
    }
    if policy == "full_restart":
        backs = []
        kills = [r for r in records if r["event"] == FAULT_INJECT]
        restarts = [r for r in records if r["event"] == JOB_RESTART]
        commits = [r for r in records if r["event"] == STEP_COMMIT]
        for k in kills:
            rs = [x for x in restarts if x["t"] > k["t"]]
            if rs:
                after = [c["t"] for c in commits if c["t"] > rs[0]["t"]]
                if after:
                    backs.append(min(after) - k["t"])
        row["full_restart_back_s"] = _stats(backs)
    row["phases_s"] = _phase_medians(records, recs)
    if starts := _start_medians(records):
        row["start_s"] = starts
    if (cfg.replicas, cfg.ranks) != (3, 1):
        row["replicas"], row["ranks"] = cfg.replicas, cfg.ranks
    if cfg.program.enabled:
        row["cold_start_to_first_commit_s"] = _stats(_cold_starts(records))
        if cfg.program.sync_every > 1:  # the semi-synchronous programs print a digest per sync
            row["weights_match"] = _syncs_match(run_dir / "logs")
        if "train_hsdp.py" in " ".join(cfg.program.command):  # a checksum of each rank's shards
            row["weights_match"] = _shards_match(run_dir / "logs")
        return row  # otherwise weights are not observed: the program reports no checksums
    hyp = evaluate_hypotheses(Hypotheses(replicas_equal_after_heal=True), {}, records)
    row["weights_match"] = all(h["passed"] for h in hyp)
    return row


def _shards_match(logs: Path) -> bool | None:
    """Whether every (rank, step) that several groups' logs print (``group G rank R step S
    shards H``, tests/programs/train_hsdp.py) has one checksum: rank R of every group holds
    the same shards after the same step, heals included; None: no step printed by two groups."""
    seen: dict[tuple[str, str], set[str]] = {}
    groups: dict[tuple[str, str], set[str]] = {}
    for log in logs.glob("replica*-rank*.log"):
        for m in re.finditer(
            r"group (\d+) rank (\d+) step (\d+) shards ([0-9a-f]+)", log.read_text()
        ):
            seen.setdefault((m[2], m[3]), set()).add(m[4])
            groups.setdefault((m[2], m[3]), set()).add(m[1])
    shared = [k for k, g in groups.items() if len(g) > 1]
    return all(len(seen[k]) == 1 for k in shared) if shared else None


def _syncs_match(logs: Path) -> bool | None:
    """Whether every sync that several groups' logs print (``sync S checksum H``, from
    tests/programs/train_diloco.py and train_localsgd.py) has one digest; None: no sync seen by
    two groups."""
    seen: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for log in logs.glob("replica*-rank0.log"):
        for sync, digest in re.findall(r"^sync (\d+) checksum (\w+)", log.read_text(), re.M):
            seen.setdefault(int(sync), set()).add(digest)
            counts[int(sync)] = counts.get(int(sync), 0) + 1
    shared = [s for s, n in counts.items() if n > 1]
    return all(len(seen[s]) == 1 for s in shared) if shared else None


def _start_medians(records: list[dict]) -> dict[str, float]:
    """Median seconds of a replacement trainer's construction (``seconds``) and of each of its
    parts, over the ``trainer.start`` records after the first kill (every rank's)."""
    kills = [r["t"] for r in records if r["event"] == FAULT_INJECT]
    starts = [r for r in records if r["event"] == TRAINER_START and kills and r["t"] > kills[0]]
    parts: dict[str, list[float]] = {"seconds": [r["seconds"] for r in starts]}
    for r in starts:
        for part, s in r["parts"].items():
            parts.setdefault(part, []).append(s)
    return {k: round(statistics.median(xs), 3) for k, xs in parts.items() if xs}


def _phase_medians(records: list[dict], recs: list[dict]) -> dict[str, float]:
    """Median seconds from each kill to each recovery phase of the group it killed."""
    kill_t = {r.get("fault_id"): r["t"] for r in records if r["event"] == FAULT_INJECT}
    since: dict[str, list[float]] = {}
    for rec in recs:
        t0 = kill_t.get(rec.get("fault_id"))
        if t0 is None:
            continue
        for phase, t in (rec.get("phases") or {}).items():
            since.setdefault(phase, []).append(t - t0)
    return {phase: round(statistics.median(xs), 3) for phase, xs in since.items()}


def _step_time(records: list[dict[str, Any]]) -> float | None:
    """The median step time: the trainer's own figure, else (a program) the median gap between
    a group's consecutive commits."""
    commits = [r for r in records if r["event"] == STEP_COMMIT]
    own = [r["step_time_s"] for r in commits if r.get("step_time_s") is not None]
    if own:
        return round(statistics.median(own), 4)
    gaps = []
    for replica in {r.get("replica") for r in commits}:
        ts = sorted(r["t"] for r in commits if r.get("replica") == replica)
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    return round(statistics.median(gaps), 4) if gaps else None


def _cold_starts(records: list[dict[str, Any]]) -> list[float]:
    """Per group: its first process start -> its first committed step (a cold start)."""
    out = []
    for replica in {r.get("replica") for r in records if r["event"] == STEP_COMMIT}:
        starts = [
            r["t"] for r in records if r["event"] == "proc.start" and r.get("replica") == replica
        ]
        commits = [
            r["t"] for r in records if r["event"] == STEP_COMMIT and r.get("replica") == replica
        ]
        if starts and commits:
            out.append(min(commits) - min(starts))
    return out


def _packaged_tiny() -> str:
    import experiments

    return str(Path(experiments.__file__).parent / "tiny.toml")


def default_reps(args: argparse.Namespace) -> int:
    """Kills per configuration: ``--reps``, else 10 (3 with ``--quick``)."""
    return args.reps or (3 if args.quick else 10)


def program_reps(args: argparse.Namespace) -> int:
    """Kills per program configuration: ``--reps``, else 10 (with ``--quick`` too)."""
    return args.reps or 10


def main(args: argparse.Namespace) -> int:
    reps = default_reps(args)
    models = ["tiny"] if args.quick else ["tiny", "llama3_debug"]
    configs = list(CONFIGS)
    programs = list(PROGRAM_CONFIGS) if PROGRAM.exists() else []  # needs a source checkout

    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench recovery] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "replicas": 3,
        "ranks": 1,
        "reps": reps,
        "program_reps": program_reps(args),
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="ftharness-bench-") as tmp:
        for model in models:
            result["rows"][model] = {}
            for name in configs + (programs if model == "tiny" else []):
                if args.only and not any(t in name for t in args.only.split(",") if t):
                    continue
                log(f"{model} / {name}: starting")
                n = program_reps(args) if name in PROGRAM_CONFIGS else reps
                row = run_config(model, name, n, seed=7, workdir=Path(tmp), log=log)
                result["rows"][model][name] = row
                log(f"{model} / {name}: {json.dumps(row)}")
    tiny = result["rows"].get("tiny", {})
    best = tiny.get("in_place/tree") or tiny.get("in_place/torchft")
    full = tiny.get("full_restart")

    def med(row: dict | None, key: str) -> float | None:
        v = (row or {}).get(key)
        return v["median"] if v else None

    if best and full:
        fb, bb = med(full, "full_restart_back_s"), med(best, "replacement_back_s")
        fs, bs = med(full, "survivor_stall_s"), med(best, "survivor_stall_s")
        result["vs_full_restart"] = {
            "replacement_back_ratio": round(fb / bb, 2) if fb and bb else None,
            "survivor_stall_ratio": round(fs / bs, 2) if fs and bs else None,
        }
    result["vs_builtin"] = {
        name: _vs_builtin(tiny, name) for name in programs if tiny.get(name) is not None
    }
    result["sharded_vs_unsharded"] = {
        model: _sharded_vs(rows) for model, rows in result["rows"].items() if "sharded/tree" in rows
    }
    print(json.dumps(result))
    return 0


def _median(row: dict | None, key: str) -> float | None:
    v = (row or {}).get(key)
    return v["median"] if v else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _sharded_vs(rows: dict[str, Any]) -> dict[str, float | None]:
    """The sharded row's killed group back, against the unsharded rows of the same model (goal:
    at most 1.5x), and its survivors' stall (goal: p50 <= 0.1 s, p95 <= 0.3 s)."""
    sharded = rows["sharded/tree"]
    back = _median(sharded, "replacement_back_s")
    stall = sharded.get("survivor_stall_s") or {}
    return {
        "back_over_unsharded_1rank": _ratio(
            back, _median(rows.get("in_place/tree"), "replacement_back_s")
        ),
        "back_over_replicated_2ranks": _ratio(
            back, _median(rows.get("replicated_2ranks/tree"), "replacement_back_s")
        ),
        "stall_p50_s": stall.get("median"),
        "stall_p95_s": stall.get("p95"),
        "stall_p50_steps": (sharded.get("survivor_stall_steps") or {}).get("median"),
    }


def _vs_builtin(rows: dict[str, Any], name: str) -> dict[str, float | None]:
    """A program's figures against its own cold start and the built-in trainer's stall."""

    def med(row: dict | None, key: str) -> float | None:
        v = (row or {}).get(key)
        return v["median"] if v else None

    quorum = name.split("/", 1)[1]
    prog, builtin = rows[name], rows.get(f"in_place/{quorum}")
    cold_row = rows.get(f"program/{quorum}")
    back, cold = med(prog, "replacement_back_s"), med(cold_row, "cold_start_to_first_commit_s")
    stall, builtin_stall = med(prog, "survivor_stall_s"), med(builtin, "survivor_stall_s")
    return {
        "replacement_back_over_cold_start": round(back / cold, 2) if back and cold else None,
        "survivor_stall_over_builtin": (
            round(stall / builtin_stall, 2) if stall and builtin_stall else None
        ),
    }
