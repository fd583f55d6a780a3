"""``ftharness run``: run a job config to completion on the supervision tree, with telemetry.

:func:`main` checks the config and hands the run to a keeper, which runs :func:`run_job` in a
controller process of its own (``harness.job.controller_proc``, ``harness.keeper.keeper``). The job
itself (the tree per policy, placement, the recovery protocol) is ``harness.job.protocol``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.config import ConfigError, JobConfig, load_config
from harness.corpus.job import resolve_data
from harness.job import checkpoint_dir, takeover
from harness.job.preflight import PreflightFailed
from harness.job.progress import say
from harness.job.protocol import Job
from harness.job.site import prepare_site
from harness.job.takeover import Plan
from runtime.channel import ChannelError
from runtime.failure import SupervisionError
from runtime.journal import JOB_END, Journal, Record
from runtime.launchers.netns import NetnsError
from runtime.launchers.slurm_text import SlurmError

#: What starting a job raises when a host cannot serve it, said as it is (no traceback): an agent
#: that refuses the job (``runtime.host_registry.AgentRefused``: no address where ``network.*``
#: says) or never dials in, a launcher that cannot start one.
CANNOT_START = (ChannelError, NetnsError, SlurmError)


class CannotStart(RuntimeError):
    """The job's hosts could not be started; the message says why (a failed outcome, rc 1)."""


def run_job(
    cfg: JobConfig,
    run_dir: str | Path,
    *,
    journal: Journal | None = None,
    quiet: bool = False,
    on_started: Callable[[Job], Callable[[], None] | None] | None = None,
    timeout: float | None = None,
    duration_s: float | None = None,
    stop_event: threading.Event | None = None,
    survivable: bool = False,
    plan: Plan | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` to completion (or failure) and return its outcome; the journal is written
    to ``run_dir/journal.jsonl`` unless one is given. ``on_started(job)`` runs once training
    is under way (the chaos runner starts its injector there) and may return a callable that
    is called before the job stops. ``survivable``: the job outlives this controller (its
    agents and workers wait for a new one: ``harness.job.takeover``); ``plan``: this
    controller takes over the job a dead one ran (``harness.job.takeover.take_over``)."""
    from harness.rundir import make_private_dir

    run_dir = make_private_dir(run_dir)  # weights, logs, tracebacks: the user's alone
    make_private_dir(run_dir / "logs")
    own = journal is None
    journal = journal or Journal(
        run_dir / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy
    )
    job: Job | None = None
    before_stop = None
    ckpt_hold: checkpoint_dir.Hold | None = None
    t0 = time.time()
    try:
        # The config as it will run: resolved here, once, before anything starts
        # (harness.job.site); a launcher that cannot start (no allocation) fails the run.
        try:
            ckpt_hold = _hold_checkpoints(cfg, run_dir, takeover=plan is not None)
            site = prepare_site(cfg, run_dir, say=None if quiet else say)
            job = Job(site, run_dir, journal, quiet=quiet, survivable=survivable, plan=plan)
            job.start()
        except CANNOT_START as exc:  # said plainly: no traceback for a host that cannot serve
            raise CannotStart(f"the job could not start: {exc}") from exc
        if on_started is not None:
            before_stop = on_started(job)
        outcome = job.wait(timeout, duration_s, stop_event)
    except SupervisionError as exc:
        outcome = {"status": "failed", "reason": exc.failure.report(), "steps": 0}
    except (PreflightFailed, CannotStart) as exc:  # a network path, a host: nothing trained
        outcome = {"status": "failed", "reason": str(exc), "steps": 0}
    except Exception as exc:
        steps = job.tracker.committed_step if job is not None else 0
        outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "steps": steps}
        raise
    finally:
        if before_stop is not None:
            before_stop()
        if job is not None:
            job.stop()
        if ckpt_hold is not None:
            ckpt_hold.release()
        outcome_ = locals().get("outcome") or {"status": "failed", "reason": "interrupted"}
        journal.emit(
            JOB_END,
            status=outcome_["status"],
            reason=outcome_["reason"],
            steps=job.tracker.committed_step if job is not None else 0,
            seconds=time.time() - t0,
        )
        if own:
            journal.close()
    outcome["recoveries"] = job.tracker.completed if job is not None else 0
    outcome["run_dir"] = str(run_dir)
    return outcome


def _hold_checkpoints(
    cfg: JobConfig, run_dir: Path, *, takeover: bool
) -> checkpoint_dir.Hold | None:
    """Hold the job's checkpoint folder for its life, once it is checked
    (``harness.job.checkpoint_dir``); CannotStart if it cannot be this job's. A takeover checks
    and holds nothing: the folder was its job's already, and the controller it replaces may
    still be alive behind a partition, holding it."""
    root = checkpoint_dir.checkpoint_root(cfg, run_dir)
    if root is None or takeover:
        return None
    problem = checkpoint_dir.problem(cfg, run_dir)
    if problem is not None:
        raise CannotStart(problem)
    try:
        return checkpoint_dir.hold(root, run_dir)
    except checkpoint_dir.CheckpointDirHeld as e:  # taken since the check
        raise CannotStart(str(e)) from None


def take_over(
    cfg: JobConfig,
    run_dir: Path,
    duration_for: Callable[[list[Record]], float | None] | None = None,
    **run_kwargs: Any,
) -> dict[str, Any]:
    """Take over the job running in ``run_dir`` (``ftharness`` keeper: ``python -m
    harness.job.controller_proc RUN --takeover``) and see it to its end, as :func:`run_job` does
    for a job it starts; ``harness.job.takeover.TakeoverRefused``, before anything changes, if
    it cannot be. ``duration_for(records)``: the run's duration, from the journal the takeover
    read (read once: it can be long)."""
    from runtime import control_file

    why = takeover.supported(cfg)
    if why is not None:
        raise takeover.TakeoverRefused(why)
    info = control_file.read_control(run_dir / "controller.json")
    if info is None:
        raise takeover.TakeoverRefused(
            f"{run_dir / 'controller.json'} is missing: no controller ran here"
        )
    secret = control_file.read_secret(run_dir / "secret")
    plan = takeover.read_run(run_dir, secret, info.epoch)
    if cfg.program.enabled:  # the programs' tap and stores, read (and checked) before anything
        from harness.job.program import takeover as program_takeover

        program_takeover.load(run_dir)
    if duration_for is not None:
        run_kwargs["duration_s"] = duration_for(plan.records)
    return run_job(cfg, run_dir, plan=plan, **run_kwargs)


def main(args: argparse.Namespace) -> int:
    """``ftharness run``: check the config (bad input is refused before anything starts), write
    it to ``RUN/job.json``, and keep the run's controller running in a process of its own
    (harness.keeper.keeper, docs/controller.md): here, or with ``--detach`` in the background."""
    overrides = list(args.overrides)
    if args.prometheus_port is not None:
        overrides.append(f"telemetry.prometheus_port={args.prometheus_port}")
    if getattr(args, "launcher", None):
        overrides.append(f"launcher={args.launcher}")
    try:
        cfg = load_config(args.config, overrides)
        resolve_data(cfg, None if args.quiet else say)  # a bad corpus: refused before the run
    except (ConfigError, FileNotFoundError) as exc:
        print(f"ftharness run: {exc}", file=sys.stderr)
        return 2
    from harness.job.slurm import check_allocation

    problem = check_allocation(cfg) or checkpoint_dir.problem(cfg, None)
    if problem is not None:
        print(f"ftharness run: {problem}", file=sys.stderr)
        return 2
    from harness.keeper.keeper import Keeper
    from harness.runctl import start_detached
    from harness.rundir import CONSOLE_FILE, run_dir_for, write_job_file

    run_dir = run_dir_for("run", args.out, cfg.name)
    if run_dir is None:
        return 2
    write_job_file(run_dir, cfg, quiet=args.quiet, source=args.config)
    if getattr(args, "detach", False):
        pid = start_detached(run_dir)
        if pid is None:
            return 1
        print(
            f"{cfg.name}: running in the background in {run_dir} (keeper pid {pid}); its output "
            f"goes to {run_dir / CONSOLE_FILE}\n"
            f"  follow it:  ftharness attach {run_dir}\n"
            f"  its state:  ftharness status {run_dir}\n"
            f"  stop it:    ftharness stop {run_dir}"
        )
        return 0
    return Keeper.for_job(run_dir, cfg).run()


def attach_telemetry(cfg: JobConfig, journal: Journal, *, quiet: bool = False) -> Any:
    """OpenTelemetry from the journal, when the config asks for an exporter."""
    tc = cfg.telemetry
    if tc.prometheus_port is None and tc.otlp_endpoint is None:
        return None
    from dashboards.telemetry import Telemetry

    telemetry = Telemetry(
        cfg.name,
        prometheus_port=tc.prometheus_port,
        prometheus_host=cfg.bind_host,
        otlp_endpoint=tc.otlp_endpoint,
    )
    journal.add_sink(telemetry.sink)
    if telemetry.prometheus_address and not quiet:
        host, port = telemetry.prometheus_address
        print(f"Prometheus metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
    return telemetry
