"""``ftharness chaos EXPERIMENT.toml``: hypothesis -> schedule -> faults -> verify -> report.

For each run of the experiment (``ExperimentSpec.runs``: each policy it names, in order, on the
same seed, and the pieces of its fault-free ``control`` interleaved with them), run the job for
the run's duration, with the fault injector walking the plan except in the control, each run in
its own folder (``OUT/<policy>/journal.jsonl``, ``OUT/control-<i>/...``, its own checkpoints).
An experiment whose plan can kill the controller (``controller_crash``) runs each faulted run's
job with its controller in a process of its own under a keeper (``experiments.chaos_job``).
Once a run's job has stopped, record what it left behind (live processes, ``/dev/shm``
segments) in ``OUT/<folder>/postrun.json``
(see experiments/postrun.py). Then compute the report and the HTML dashboard from the journals
and those records alone, and exit non-zero if a hypothesis failed or a run failed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dashboards.html import write_dashboard
from experiments import postrun
from experiments.spec import CONTROL, ExperimentError, ExperimentSpec, Run, load_experiment
from harness.rundir import LEFT_BEHIND_FILE, make_private_dir, read_json, run_dir_for
from runtime.journal import FAULT_INJECT, JOB_END, JOB_START, Journal, Record, read_journal


def job_config(spec: ExperimentSpec, policy: str) -> Any:
    return spec.job_config(policy)


def run_policy(
    spec: ExperimentSpec,
    run: Run,
    out: Path,
    *,
    quiet: bool,
    prometheus_port: int | None,
    limit: Any = None,
    extra_overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    policy = run.policy
    cfg = job_config(spec, policy)
    # ``out`` was new or empty (choose_run_dir), so this run's folder is fresh: nothing to
    # resume from or mix into the report.
    run_dir = make_private_dir(out / run.folder)
    stamp: dict[str, Any] = {"policy": policy}
    if run.control_run is not None:
        stamp["control_run"] = run.control_run
    journal = Journal(run_dir / "journal.jsonl", job=spec.name, **stamp)
    if prometheus_port is not None:
        import dataclasses

        cfg = dataclasses.replace(
            cfg, telemetry=dataclasses.replace(cfg.telemetry, prometheus_port=prometheus_port)
        )
    before = postrun.snapshot()
    if spec.kills_controller and policy != CONTROL:  # its controller in a process of its own
        from experiments.chaos_job import run_under_keeper

        outcome = run_under_keeper(
            spec, run, run_dir, cfg, quiet=quiet, extra_overrides=extra_overrides
        )
    else:
        outcome = _run_here(spec, run, run_dir, cfg, journal, quiet=quiet, limit=limit)
    records = _check_after(run_dir, before, policy, outcome.pop("left_behind", ()))
    return {**outcome, "faults_fired": _fired(records)}


def _fired(records: list[Record]) -> int:
    return sum(1 for r in records if r.get("event") == FAULT_INJECT)


def _run_here(
    spec: ExperimentSpec, run: Run, run_dir: Path, cfg: Any, journal: Journal, *, quiet: bool,
    limit: Any,
) -> dict[str, Any]:  # fmt: skip
    """:func:`run_policy`'s job with its controller in this process."""
    from experiments.chaos_job import start_faults
    from harness.job.launch import attach_telemetry, run_job

    telemetry = attach_telemetry(cfg, journal, quiet=quiet)

    def on_started(job: Any) -> Any:
        if limit is not None:
            limit.on_started(job)
        if run.policy == CONTROL:
            job.progress.say(f"{run.folder}: no faults, {run.duration_s} s (goodput's baseline)")
            return None
        return start_faults(spec, run.policy, job, None, where="in this process")

    try:
        return run_job(
            cfg,
            run_dir,
            journal=journal,
            quiet=quiet,
            on_started=on_started,
            duration_s=run.duration_s,
            stop_event=limit.stop_event if limit is not None else None,
        )
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        journal.close()


def _check_after(
    run_dir: Path,
    before: postrun.Before,
    policy: str,
    left_behind: Iterable[dict[str, Any]] = (),
    stopped_by: str = "the keeper",
    run_end: float | None = None,
) -> list[Record]:
    """After a run's job stopped: the orphan and /dev/shm checks (``no_orphans``,
    ``no_shm_left``) into ``postrun.json``; a process a keeper had to stop at the end
    (``left_behind``) is an orphan too. Returns the run's journal."""
    records = read_journal(run_dir / "journal.jsonl")
    end = time.time() if run_end is None else run_end
    checked = postrun.check(before, records, policy=policy, run_end=end)
    checked["orphans"] += [
        {**left, "source": f"stopped by {stopped_by} when the run ended"} for left in left_behind
    ]
    postrun.write(run_dir, checked)
    return records


def _resumable(out: str | None) -> Path | None:
    """``--resume``'s experiment directory: ``--out``, which an earlier ``ftharness chaos`` of
    the experiment started (it holds ``experiment.toml``); None (said on stderr) if not."""
    if out is None or not (Path(out) / "experiment.toml").is_file():
        print(
            f"ftharness chaos: --resume needs --out naming an experiment directory an earlier "
            f"`ftharness chaos` started (with its experiment.toml); got {out!r}",
            file=sys.stderr,
        )
        return None
    return Path(out)


def _ended(run_dir: Path, policy: str) -> dict[str, Any]:
    """A run an earlier runner started, kept by ``--resume``: its outcome from its journal. A
    run whose runner died (its controller's node lost, a standby's keeper finished the run) has
    no post-run check yet: it is done now, by the journal's processes alone (no snapshot of what
    ran before it exists)."""
    from experiments.chaos_job import outcome_of

    records = read_journal(run_dir / "journal.jsonl")
    outcome = {**outcome_of(records, 0), "faults_fired": _fired(records)}
    if not (run_dir / postrun.POSTRUN_FILE).exists():
        starts = [r["t"] for r in records if r.get("event") == JOB_START]
        ends = [r["t"] for r in records if r.get("event") == JOB_END]
        before = postrun.Before(
            t=starts[0] if starts else time.time(), descendants=frozenset(), shm=frozenset()
        )
        left = (read_json(run_dir / LEFT_BEHIND_FILE) or {}).get("left_behind", [])
        _check_after(
            run_dir, before, policy, left, "the standby's keeper", ends[-1] if ends else None
        )
    return outcome


def with_launcher(path: str | Path, launcher: str) -> ExperimentSpec:
    """The experiment file with its job's launcher overridden (``--launcher``), validated as a
    whole with it: a [slurm] section and SLURM faults are checked against the new launcher."""
    return load_experiment(path, (f"launcher={launcher}",))


def main(args: argparse.Namespace) -> int:
    extra: tuple[str, ...] = ()
    try:
        if getattr(args, "launcher", None):
            spec = with_launcher(args.experiment, args.launcher)
            extra = (f"launcher={args.launcher}",)
        else:
            spec = load_experiment(args.experiment)
    except (ExperimentError, FileNotFoundError) as exc:
        print(f"ftharness chaos: {exc}", file=sys.stderr)
        return 2
    from harness.config import ConfigError
    from harness.corpus.job import resolve_data
    from harness.job.progress import say
    from harness.job.slurm import TimeLimit, check_allocation

    first = spec.job_config(spec.policies[0])  # the checks below hold for every run's config
    try:
        problem = check_allocation(first)
        # the corpus prepared (first use) and checked before the first run, not during it
        resolve_data(first, None if args.quiet else say)
    except ConfigError as exc:
        problem = str(exc)
    if problem is not None:
        print(f"ftharness chaos: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "resume", False):
        out = _resumable(args.out)
    else:
        out = run_dir_for("chaos", args.out, spec.name)
    if out is None:
        return 2
    # SLURM's time-limit signal: checkpoint, stop, skip the remaining policies, write the report
    limit = TimeLimit() if first.launcher == "slurm" else None
    if spec.source is not None and not (out / "experiment.toml").exists():
        shutil.copyfile(spec.source, out / "experiment.toml")  # `ftharness report` reads it
    outcomes: dict[str, dict[str, Any]] = {}
    for run in spec.runs():
        if getattr(args, "resume", False) and (out / run.folder / "journal.jsonl").exists():
            outcomes[run.folder] = _ended(out / run.folder, run.policy)
            continue
        if not args.quiet:
            print(f"[ftharness] === {spec.name}: {run.folder} ===", file=sys.stderr)
        outcomes[run.folder] = run_policy(
            spec,
            run,
            out,
            quiet=args.quiet,
            prometheus_port=args.prometheus_port,
            limit=limit,
            extra_overrides=extra,
        )
        if limit is not None and limit.signalled.is_set():
            break

    from experiments.report import render_markdown, write_report

    problems: list[str] = []
    records = read_journal(out, problems=problems)
    report = write_report(out, records, spec.hypotheses, journal_problems=problems)
    html = write_dashboard(out, records, report["summary"])
    print(render_markdown(report["summary"], report["hypotheses"]), end="")
    for policy, o in outcomes.items():
        print(
            f"{policy}: {o['status']} ({o['reason'].splitlines()[0]}), {o['steps']} steps, "
            f"{o['faults_fired']} faults fired, {o['recoveries']} recoveries"
        )
    print(f"report: {out / 'report.md'}" + (f"  dashboard: {html}" if html else ""))
    failed_runs = [p for p, o in outcomes.items() if o["status"] != "ok"]
    if failed_runs:
        for p in failed_runs:
            print(f"run {p} failed:\n{outcomes[p]['reason']}", file=sys.stderr)
        return 1
    return 0 if report["passed"] else 1
