"""The controller in a process of its own: ``python -m harness.job.controller_proc RUN_DIR``.

``ftharness run`` no longer runs the job in its own process: it checks the config, writes it to
``RUN/job.json`` (``harness.rundir.write_job_file``), and becomes (or detaches) a keeper
(``harness.keeper.keeper``) that starts this module as its child. The controller can then die (a
bug, an OOM kill, a SIGKILL) without taking the run's record of what to run with it: the keeper
starts this module again with ``--takeover``, which hands the run to
``harness.job.launch.take_over`` (docs/controller.md).

Without ``--takeover`` this is what ``ftharness run`` did after loading the config: telemetry,
SLURM's time-limit signal, :func:`harness.job.launch.run_job`, the outcome line; same output, same
exit status (0 ok, 1 failed, 2 a job file that cannot be read, 130 Ctrl-C). A job that a new
controller could take over (``harness.job.takeover.supported``) runs ``survivable``: its agents
and workers outlive this process; any other job runs exactly as before.

Signals: SIGINT (Ctrl-C reaches the whole foreground process group) stops the job cleanly as it
did; SIGTERM (``ftharness stop``, forwarded by the keeper) stops it cleanly too, the run ending
``ok`` with "stopped by its caller". Under SLURM the time limit's handlers keep SIGTERM and
SIGUSR1 as before (``harness.job.slurm.TimeLimit``). The keeper's pid comes in
``FTHARNESS_KEEPER_PID``: the controller asks the kernel for a SIGTERM when its keeper dies, so a
killed keeper (``kill -9``, a test's timeout) stops its run cleanly instead of leaving it
unattended.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.config import JobConfig
from harness.keeper.keeper import BEAT_ENV, BEAT_INTERVAL_S, KEEPER_ENV
from harness.rundir import job_file_or_say

if TYPE_CHECKING:
    from harness.job.protocol import Job


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or take over) the job of ``RUN_DIR``; returns the exit status (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.job.controller_proc",
        description="The controller of a run that `ftharness run` prepared (started by its "
        "keeper, not by hand).",
    )
    parser.add_argument("run_dir")
    parser.add_argument(
        "--takeover", action="store_true", help="take over from a controller that died"
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="import everything, then wait for the keeper to say 'takeover' on stdin",
    )
    args = parser.parse_args(argv)
    if args.standby and not _stand_by():
        return 0  # the run ended (the keeper closed our stdin): nothing to take over
    run_dir = Path(args.run_dir)
    read = job_file_or_say(run_dir)
    if read is None:
        return 2
    cfg, job = read
    quiet = bool(job.get("quiet"))
    from harness.job.slurm import TimeLimit

    # The handlers first, then the tie to the keeper: its SIGTERM must find them in place.
    limit = TimeLimit() if cfg.launcher == "slurm" else None
    stop_event = limit.stop_event if limit is not None else threading.Event()
    if limit is None:
        signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    keeper = os.environ.get(KEEPER_ENV, "")
    if keeper.isdigit():
        from runtime.proctree import die_with_parent

        die_with_parent(int(keeper), signal.SIGTERM)  # exits now if the keeper is already gone
    beat_to_keeper()
    try:
        return _run(
            run_dir,
            cfg,
            quiet=quiet,
            limit=limit,
            stop_event=stop_event,
            takeover=args.takeover or args.standby,
            hook=job.get("hook"),
        )
    except KeyboardInterrupt:  # as ftharness's own main says it (harness.cli)
        print("interrupted", file=sys.stderr)
        return 130


#: What must answer for the controller to beat: once the job runs, its control plane
#: (``Controller.stuck``: its lock, its monitor, its supervision thread), so that a controller
#: stuck there stops beating. Each returns why it is stuck, or None.
_PROBES: list[Callable[[], str | None]] = []


def beat_to_keeper() -> None:
    """Write a byte to the keeper's beat pipe (``FTHARNESS_KEEPER_BEAT_FD``) every
    ``BEAT_INTERVAL_S`` from a thread of its own, while every probe in ``_PROBES`` answers: a
    controller that stops beating (SIGSTOPped, its interpreter wedged, its control plane
    deadlocked) is killed by the keeper and replaced (``harness.keeper.keeper``)."""
    fd = os.environ.get(BEAT_ENV, "")
    if not fd.isdigit():
        return

    def beat() -> None:
        told = False
        while True:
            why = next((w for probe in list(_PROBES) if (w := probe()) is not None), None)
            if why is None:
                told = False
                try:
                    os.write(int(fd), b".")
                except OSError:
                    return  # the keeper is gone (and this process with it, by die_with_parent)
            elif not told:
                told = True
                print(f"controller stuck, not beating to its keeper: {why}", file=sys.stderr)
            time.sleep(BEAT_INTERVAL_S)

    threading.Thread(target=beat, daemon=True, name="ftharness-keeper-beat").start()


def _stand_by() -> bool:
    """A standby controller (``harness.keeper.keeper``): everything a takeover imports, imported
    now (torch, the job, the quorum service: about a second here), then wait for the keeper's
    word on stdin. True: take over now; False: the run ended (end of file). Ctrl-C is the
    serving controller's business until then."""
    import harness.job.launch
    import harness.quorum.service
    import harness.rank.model  # noqa: F401  (torch, and the model code the agents preload)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    word = sys.stdin.readline().strip()
    signal.signal(signal.SIGINT, previous)
    return word == "takeover"


def _run(
    run_dir: Path,
    cfg: JobConfig,
    *,
    quiet: bool,
    limit: Any,
    stop_event: threading.Event,
    takeover: bool,
    hook: dict[str, Any] | None = None,
) -> int:
    """The job, as ``ftharness run`` ran it after loading the config: a first controller starts
    it (:func:`harness.job.launch.run_job`), a later one takes it over (:func:`_take_over`).
    ``hook``: what the program that wrote ``job.json`` adds to each of its controllers
    (:func:`make_hook`; ``ftharness chaos``'s injector, ``experiments.chaos_job``)."""
    from harness.job.launch import attach_telemetry, run_job
    from runtime.journal import Journal

    stamp: dict[str, Any] = {"job": cfg.name, "policy": cfg.recovery.policy}
    kwargs: dict[str, Any] = {
        "quiet": quiet,
        "on_started": limit.on_started if limit is not None else None,
        "stop_event": stop_event,
    }
    if hook is not None:
        extra = make_hook(hook)
        stamp = extra.journal_stamp()
        kwargs["on_started"] = extra.on_started
        if takeover:  # from the journal the takeover reads anyway
            kwargs["duration_for"] = extra.duration_left
        else:
            kwargs["duration_s"] = extra.duration_left(None)
    first = kwargs["on_started"]

    def started(job: Job) -> Any:  # from now on, a deadlocked control plane stops the beat
        _PROBES.append(lambda: job.controller.stuck(BEAT_INTERVAL_S))
        return first(job) if first is not None else None

    kwargs["on_started"] = started
    journal = Journal(run_dir / "journal.jsonl", **stamp)
    kwargs["journal"] = journal
    telemetry = attach_telemetry(cfg, journal, quiet=quiet)
    try:
        if takeover:
            outcome = _take_over(run_dir, cfg, journal, kwargs)
        else:
            outcome = run_job(cfg, run_dir, **_survival(cfg), **kwargs)
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        journal.close()
    return report(cfg, run_dir, outcome)


def make_hook(hook: dict[str, Any]) -> Any:
    """``job.json``'s ``hook``: ``{"factory": "module:callable", "args": {...}}``, the callable
    called with ``args``. What it returns gives the journal's stamp (``journal_stamp()``), the
    run's duration (``duration_left(records)``: None for a first controller, the journal so far
    for one that takes over) and ``run_job``'s ``on_started(job)``. It is how ``ftharness
    chaos`` runs its injector in each controller without this package importing it."""
    import importlib

    module, _, name = str(hook["factory"]).partition(":")
    return getattr(importlib.import_module(module), name)(hook.get("args") or {})


def report(cfg: JobConfig, run_dir: Path, outcome: dict[str, Any]) -> int:
    """The outcome line ``ftharness run`` has always ended with, and its exit status."""
    print(
        f"\n{cfg.name}: {outcome['status']} — {outcome['steps']} steps committed, "
        f"{outcome.get('recoveries', 0)} recoveries; journal {run_dir / 'journal.jsonl'}"
    )
    if outcome["status"] != "ok":
        print(outcome["reason"], file=sys.stderr)
        return 1
    return 0


def _survival(cfg: JobConfig) -> dict[str, Any]:
    """``survivable=True`` for ``run_job`` when a new controller could take this job over
    (``harness.job.takeover.supported``): then its agents and workers outlive this process.
    Any other job runs exactly as before."""
    from harness.job.takeover import supported

    return {"survivable": True} if supported(cfg) is None else {}


def _take_over(
    run_dir: Path, cfg: JobConfig, journal: Any, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A new controller for a run whose controller died (``harness.job.takeover``). One that
    cannot take over (refused, with the reason) ends the run here, failed, with the reason in
    the journal's ``job.end``: the keeper, ``attach`` and ``status`` then see a run that ended
    rather than one that vanished."""
    from harness.job.launch import take_over
    from harness.job.takeover import TakeoverRefused
    from runtime.control_file import ControlFileError

    try:
        return take_over(cfg, run_dir, **kwargs)
    except (TakeoverRefused, ControlFileError) as exc:
        return _cannot_take_over(run_dir, journal, str(exc))


def _cannot_take_over(run_dir: Path, journal: Any, why: str) -> dict[str, Any]:
    from harness.rundir import run_totals
    from runtime.journal import JOB_END, read_journal

    totals = run_totals(read_journal(run_dir / "journal.jsonl"))
    reason = f"the controller died and no new one could take over: {why}"
    journal.emit(JOB_END, status="failed", reason=reason, **totals)
    return {"status": "failed", "reason": reason, "steps": totals["steps"]}


if __name__ == "__main__":
    sys.exit(main())
