"""A chaos run whose controller may be killed (``controller_crash``): its job runs under a keeper.

``ftharness chaos`` runs a run's job in its own process, except when the plan can kill the
controller (``ExperimentSpec.kills_controller``). Then it does what ``ftharness run`` does: it
writes the job, and what the controller needs of the experiment, to ``RUN/job.json``
(:func:`run_under_keeper`), and keeps the controller (``harness.job.controller_proc``) running
under a :class:`harness.keeper.keeper.Keeper` in its own process, which hands the run to a new
controller each time one dies (docs/controller.md).

In the controller, :class:`ChaosHook` starts the fault injector once training is under way with
:func:`start_faults`, as the in-process runner does; a controller that takes over resumes it
from the journal (the plan is there, as ``fault.plan``: no fault fired twice, held faults healed
at their time), and its run lasts what the first controller's duration left (or, with
``settle_s``, until the faults are over: :func:`end_when_settled`). The runner then
reads the outcome from the journal's ``job.end``; processes the keeper had to stop at the end
count as orphans.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from experiments.spec import ExperimentSpec, Run, load_experiment
from harness.job.recovery import completed
from runtime.journal import JOB_END, JOB_START, Record, read_journal

if TYPE_CHECKING:
    from faults.injector import Injector
    from harness.job.recovery import RecoveryTracker


def run_under_keeper(
    spec: ExperimentSpec,
    run: Run,
    run_dir: Path,
    cfg: Any,
    *,
    quiet: bool,
    extra_overrides: tuple[str, ...],
) -> dict[str, Any]:
    """Run ``run`` of ``spec`` (``cfg``, its job config) in ``run_dir`` with its controller in a
    process of its own under a keeper; returns the runner's outcome dict, with ``left_behind``
    (what the keeper had to stop)."""
    from harness.keeper.keeper import Keeper
    from harness.rundir import write_job_file

    if spec.source is None:
        raise ValueError("an experiment that kills its controller must come from a file")
    section = {
        "experiment": str(Path(spec.source).resolve()),
        "overrides": list(extra_overrides),
        "policy": run.policy,
        "duration_s": run.duration_s,
    }
    hook = {"factory": f"{__name__}:ChaosHook", "args": section}
    write_job_file(run_dir, cfg, quiet=quiet, source=str(spec.source), hook=hook)
    keeper = Keeper.for_job(run_dir, cfg)
    rc = keeper.run()
    if rc == 130:  # Ctrl-C: the controller stopped the job; the experiment stops too
        raise KeyboardInterrupt
    outcome = outcome_of(read_journal(run_dir / "journal.jsonl"), rc)
    outcome["left_behind"] = keeper.left_behind
    return outcome


def outcome_of(records: list[Record], rc: int) -> dict[str, Any]:
    """What ``run_job`` returns, read off a journal a keeper's controllers wrote."""
    ends = [r for r in records if r.get("event") == JOB_END]
    recoveries = completed(records)
    if not ends:
        return {
            "status": "failed",
            "reason": f"the run's controllers ended (keeper status {rc}) without a job.end",
            "steps": 0,
            "recoveries": recoveries,
        }
    end = ends[-1]
    return {
        "status": str(end.get("status")),
        "reason": str(end.get("reason") or ""),
        "steps": int(end.get("steps") or 0),
        "recoveries": recoveries,
    }


class ChaosHook:
    """The experiment's part in each controller process (``harness.job.controller_proc``'s
    ``make_hook``), from ``job.json``'s ``hook`` (:func:`run_under_keeper`)."""

    def __init__(self, section: dict[str, Any]) -> None:
        self.spec = load_experiment(section["experiment"], tuple(section.get("overrides", ())))
        self.policy = str(section["policy"])
        self.duration_s: float | None = section.get("duration_s")

    def journal_stamp(self) -> dict[str, Any]:
        """The fields every record of the run carries, as the in-process runner stamps them."""
        return {"job": self.spec.name, "policy": self.policy}

    def duration_left(self, records: list[Record] | None) -> float | None:
        """The run's duration; for a controller that takes over (``records``: the journal so
        far), what is left of it since the injector (or the job) started."""
        if self.duration_s is None or records is None:
            return self.duration_s
        from faults.injector import plan_record

        found = plan_record(records)
        starts = [r["t"] for r in records if r.get("event") == JOB_START]
        t0 = found[0] if found is not None else (starts[0] if starts else time.time())
        return max(0.1, self.duration_s - (time.time() - t0))

    def on_started(self, job: Any) -> Callable[[], None]:
        """:func:`start_faults` (``run_job``'s ``on_started``); a controller that takes over
        (``job.plan``) resumes its predecessor's plan."""
        records = job.plan.records if job.plan is not None else None
        return start_faults(self.spec, self.policy, job, records, where="under a keeper")


def start_faults(
    spec: ExperimentSpec, policy: str, job: Any, records: list[Record] | None, *, where: str
) -> Callable[[], None]:
    """Start a faulted run's injector once its job trains, in the controller's process, whether
    the runner's own (``experiments.runner``) or one under a keeper (:class:`ChaosHook`): the
    plan drawn for the job's topology, or, from ``records`` (the journal a dead controller
    left), resumed where it was (no fault fired twice). Returns what stops it."""
    from faults.injector import plan_record
    from faults.targets import Topology

    found = plan_record(records) if records is not None else None
    plan = found[1] if found is not None else spec.plan(Topology.from_context(job.faults))
    injector = spec.injector(plan, job.faults)
    if found is not None and records is not None:
        injector.resume(records)
        job.progress.say(
            f"{policy}: the fault plan resumed ({len(injector.fired)} of {len(plan)} "
            "faults fired before the takeover)"
        )
    else:
        job.progress.say(
            f"{policy}: {len(plan)} faults planned over {spec.duration_s} s "
            f"(seed {spec.seed}), the controller {where}"
        )
    injector.start_thread()
    if spec.settle_s is None:
        return injector.close
    settled = end_when_settled(job, injector, spec.settle_s)

    def stop() -> None:
        settled.set()
        injector.close()

    return stop


#: How often :func:`end_when_settled` looks (seconds).
SETTLE_POLL_S = 0.2


class Settling(Protocol):
    """What :func:`end_when_settled` needs of a job (``harness.job.protocol.Job``)."""

    tracker: RecoveryTracker

    def end(self, reason: str) -> None: ...


def end_when_settled(job: Settling, injector: Injector, settle_s: float) -> threading.Event:
    """End ``job`` well (``job.end``) once ``injector`` is done (every planned fault fired or
    skipped, and healed) and no recovery has been open (``job.tracker.open_count``) for
    ``settle_s`` (the experiment's ``settle_s``), on a daemon thread. Returns the event that
    stops the watch."""
    stop = threading.Event()

    def watch() -> None:
        quiet_since: float | None = None
        while not stop.wait(SETTLE_POLL_S):
            now = time.monotonic()
            if not injector.done or job.tracker.open_count:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= settle_s:
                job.end(
                    f"its faults are over: every planned fault fired and every recovery "
                    f"closed, then {settle_s:g} s of training (settle_s)"
                )
                return

    threading.Thread(target=watch, name="ftharness-settle", daemon=True).start()
    return stop
