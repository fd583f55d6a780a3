"""A new controller takes over a running job: what it reads, what it refuses, what it adopts.

The controller is a process that can die (``issues show 26``, ``docs/controller.md``). When it
does, its keeper (``harness.keeper.keeper``) starts a new one with ``--takeover``, and the host
agents and workers keep training for ``recovery.controller_grace_s`` meanwhile (``runtime``).
The new controller knows nothing it cannot read from the run directory or hear from the agents:

* ``journal.jsonl``: the job's history. Each group start is journaled as ``group.start`` with
  its replica, incarnation, host and processes, numbered and signed with the job secret
  (:func:`sign`), so a journal edited by hand, or one that lost a group's start, is refused
  instead of half-adopted: a process nobody can account for would be killed, a group trained on
  by a controller that does not know it.
* ``secret``: the job secret (mode 0600): agents re-dial with it, and it signs the records.
* ``controller.json``: the last controller's address and epoch; the new one serves at epoch + 1
  and every agent and worker obeys only the highest epoch it has seen, so the old controller,
  if it comes back, commands nothing.
* ``quorum.json``: the tree quorum's durable state (``harness.quorum.service``): the same port,
  members and secret, quorum ids above every one issued, steps that never go back.

Then the agents re-dial and report their live workers (``Controller.reattach``); each group the
journal says runs is adopted whole if every rank's process is alive (its running ``train`` call
included), else restarted in place like any failed group; one the journal says was dropped
(``group.dropped``: a crash loop of its own) is neither. A host whose agent did not re-dial
within the grace window is lost, as a host is. The takeover is a recovery in the journal
(cause ``controller_crash``): detected when the new controller starts, ``replacement_started``
once it serves, ``participating`` at the first commit after it.

It supports the built-in trainer on the local and SLURM launchers with the tree quorum (under
SLURM the new controller may run on another node: ``harness.keeper.standby_node``), and a
``[program]`` job running torchft's Manager (``harness.job.program.takeover``; under SLURM its
programs reach the quorum tap through their host agent's relay, ``runtime.relay``): any other
job (another launcher or quorum service, torchtitan's program) is refused with the reason (the
run then ends as it would have without a keeper).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from harness.config import JobConfig
from harness.job.preflight import Checked
from harness.job.replica_group import ReplicaGroup
from runtime.journal import (
    CONTROLLER_TAKEOVER,
    GROUP_DROPPED,
    GROUP_START,
    JOB_END,
    JOB_START,
    Record,
    read_journal,
)

if TYPE_CHECKING:
    from harness.job.recovery import RecoveryTracker


class TakeoverRefused(RuntimeError):
    """This run directory cannot be taken over; the message says why. Nothing was changed."""


def sign(secret: bytes, fields: dict[str, Any]) -> str:
    """The HMAC-SHA256 (job secret) of ``fields`` as canonical JSON: a record a takeover trusts
    carries it, so no one without the secret can add, change or renumber one."""
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def signed_fields(record: Record) -> dict[str, Any]:
    """The fields of a ``group.start`` record that its ``mac`` covers."""
    return {k: record.get(k) for k in ("replica", "incarnation", "host", "procs", "seq", "epoch")}


@dataclass(frozen=True)
class GroupPlan:
    """A group the journal says is running: adopt it if every rank is alive."""

    replica: int
    incarnation: int
    host: str
    procs: tuple[str, ...]  # by rank


@dataclass
class Plan:
    """What a takeover found in the run directory (:func:`read_run`)."""

    groups: dict[int, GroupPlan]
    committed_step: int
    records: list[Record]
    epoch: int  # the last controller's
    secret: bytes
    #: Groups dropped for a crash loop of their own (``group.dropped``): never started again.
    dropped: frozenset[int] = frozenset()


def supported(cfg: JobConfig) -> str | None:
    """Why a job cannot be taken over in this slice, or None."""
    if cfg.program.enabled and (why := _program_refusal(cfg)) is not None:
        return why
    if cfg.launcher not in ("local", "slurm"):
        return f'launcher = "{cfg.launcher}": only "local" and "slurm" jobs can be taken over yet'
    if cfg.recovery.quorum != "tree":
        return 'recovery.quorum = "torchft": only the tree quorum continues across a takeover'
    if cfg.recovery.policy != "in_place":
        return 'recovery.policy = "full_restart": the baseline restarts everything anyway'
    if cfg.recovery.controller_grace_s <= 0:
        return "recovery.controller_grace_s = 0: the agents died with their controller"
    return None


def _program_refusal(cfg: JobConfig) -> str | None:
    """Why a ``[program]`` job cannot be taken over (``harness.job.program.takeover``)."""
    if cfg.program.kind == "torchtitan":
        return (
            'program.kind = "torchtitan" cannot be taken over yet: torchtitan does not train on '
            "a CPU-only machine (docs/own-program.md), so no takeover of one has been tested"
        )
    return None


def read_run(run_dir: Path, secret: bytes, epoch: int) -> Plan:
    """Read and check what the last controller (of ``epoch``) left; TakeoverRefused if the
    journal cannot be trusted whole (a line that does not parse, a group start whose signature
    or sequence number is wrong) or says the job has ended."""
    path = run_dir / "journal.jsonl"
    if not path.exists():
        raise TakeoverRefused(f"{path} does not exist: nothing to take over")
    problems: list[str] = []
    records = read_journal(path, problems=problems)
    if problems:
        raise TakeoverRefused(
            f"the journal {path} is damaged ({len(problems)} unreadable record(s), first: "
            f"{problems[0]}): it was truncated or edited, and a takeover trusts it whole"
        )
    if not any(r["event"] == JOB_START for r in records):
        raise TakeoverRefused(f"the journal {path} has no {JOB_START} record: no job ran here")
    ended = [r for r in records if r["event"] == JOB_END]
    if ended:
        raise TakeoverRefused(
            f"the job has ended ({ended[-1].get('status')}: {ended[-1].get('reason')}); "
            "nothing to take over"
        )
    groups: dict[int, GroupPlan] = {}
    expected: dict[int, int] = {}  # epoch -> the next seq
    for r in (r for r in records if r["event"] == GROUP_START):
        where = f"{path}: {GROUP_START} of replica {r.get('replica')} at t={r['t']}"
        if not hmac.compare_digest(str(r.get("mac", "")), sign(secret, signed_fields(r))):
            raise TakeoverRefused(f"{where}: its signature does not match (edited by hand?)")
        ep, seq = int(r.get("epoch", 0)), int(r.get("seq", 0))
        if seq != expected.get(ep, 1):
            raise TakeoverRefused(
                f"{where}: numbered {seq}, expected {expected.get(ep, 1)}: a group start is "
                "missing from the journal (truncated?)"
            )
        expected[ep] = seq + 1
        groups[int(r["replica"])] = GroupPlan(
            replica=int(r["replica"]),
            incarnation=int(r["incarnation"]),
            host=str(r["host"]),
            procs=tuple(str(p) for p in r["procs"]),
        )
    steps = [int(r.get("step", 0)) for r in records if r["event"] == "step.commit"]
    dropped = frozenset(int(r["replica"]) for r in records if r["event"] == GROUP_DROPPED)
    return Plan(
        groups={r: g for r, g in groups.items() if r not in dropped},  # what is left of one
        # stops with every process no group claims (release_unclaimed)
        dropped=dropped,
        committed_step=max(steps, default=0),
        records=records,
        epoch=epoch,
        secret=secret,
    )


# -- the job's side (harness.job.protocol.Job calls these) ------------------------------------
class TakenOver(Checked, Protocol):
    """What a takeover reads of the job it continues (what the preflight reads, and more), and
    the one thing it tells it (a group adopted): ``harness.job.protocol.Job`` is one. Nothing
    here writes the job's attributes."""

    run_dir: Path
    tracker: RecoveryTracker
    ranks: int
    plan: Plan | None

    def relay_quorum(self) -> None: ...

    def adopted(self, group: ReplicaGroup) -> None:
        """``group`` runs, adopted as it runs: it is the job's now."""


def controller_kwargs(job: TakenOver) -> dict[str, Any]:
    """What makes ``job``'s controller one that can be replaced: the job secret kept in the run
    directory (a new controller needs it), the control file agents re-dial, and the epoch;
    for a takeover, the journal's last event of each process (its workers send the rest
    again: ``runtime.resend``)."""
    from runtime import channel, control_file
    from runtime.takeover import event_marks

    if job.plan is None:
        secret = channel.new_secret()
        control_file.write_secret(job.run_dir / "secret", secret)
        epoch = 1
    else:
        secret, epoch = job.plan.secret, job.plan.epoch + 1
    return {
        "secret": secret,
        "control_file": job.run_dir / "controller.json",
        "epoch": epoch,
        "takeover": job.plan is not None,
        "event_marks": event_marks(job.plan.records) if job.plan is not None else None,
    }


def journal_group(job: TakenOver, group: ReplicaGroup, seq: int) -> None:
    """Journal a group's start as a takeover reads it (signed and numbered: :func:`read_run`)."""
    controller = job.controller
    fields: dict[str, Any] = {
        "replica": group.replica,
        "incarnation": group.incarnation,
        "host": group.host,
        "procs": list(group.mesh.proc_ids),
        "seq": seq,
        "epoch": controller.epoch,
    }
    job.journal.emit(GROUP_START, **fields, mac=sign(controller.secret, fields))


def reattach(job: TakenOver) -> None:
    """After a takeover: serve the quorum where it was (its members' next requests reach it
    while the agents re-dial), then wait for the agents (those that do not re-dial are lost
    hosts, which the host pool restarts)."""
    cfg, t = job.cfg, job.cfg.timeouts
    names = job.host_names()
    job.quorum.start()
    job.relay_quorum()  # agents re-dialling now get its address (harness.job.protocol)
    # An agent notices a dead controller at once (its connection closes) or, cut off or
    # stopped, after controller_silence; then it re-dials every few tenths of a second.
    patience = min(cfg.recovery.controller_grace_s, t.controller_silence + t.connect_timeout)
    t0 = time.time()
    reports = job.controller.reattach(names, patience)
    t_reattached = time.time()
    lost = [n for n in names if n not in reports]
    for name in lost:
        job.hosts.respawn_lost(name)
    job.journal.emit(
        CONTROLLER_TAKEOVER,
        epoch=job.controller.epoch,
        pid=os.getpid(),
        hosts=sorted(reports),
        lost=lost,
        reattach_s=round(t_reattached - t0, 4),
        groups=sorted(job.plan.groups) if job.plan is not None else [],
    )
    if lost:
        job.say(f"takeover: no agent re-dialed from {', '.join(lost)}: restarting it")


def next_incarnation(job: TakenOver, plan: GroupPlan) -> int:
    """The incarnation a group that could not be adopted restarts as: past the journal's and
    past any the quorum service admitted (the dead controller may have admitted a replacement
    it did not live to journal)."""
    return max(plan.incarnation, job.quorum.admitted().get(plan.replica, -1)) + 1


def not_adopted(job: TakenOver, plan: GroupPlan, why: str) -> None:
    """``plan``'s group cannot be adopted (``why``): what is left of it stops, and the caller
    restarts it in place, as a recovery like any other. A rank no agent reported (its host's
    agent did not re-dial: the host, the controller's own node with ``slurm.controller_node =
    "trains"``, was lost with the old controller) failed with no failure of its own: it gets one
    here (``lost_host``). Otherwise the recovery's cause is ``not_adopted`` (a failure an agent
    saw while no controller served opened one already, which this joins)."""
    from harness.job.recovery import NOT_ADOPTED
    from runtime.failure import Cause, Failure
    from runtime.journal import FAILURE

    c = job.controller
    c.stop_procs([p for p in plan.procs if p in c.procs], grace_s=0.5)
    job.journal.emit(
        CONTROLLER_TAKEOVER, replica=plan.replica, adopted=False,
        reason=f"{why}: restarted in place",
    )  # fmt: skip
    unreported = [p for p in plan.procs if p not in c.procs]
    if unreported:
        failure = Failure(
            cause=Cause.LOST_HOST,
            detail=f"host {plan.host} was lost with the controller: no agent reported {unreported}",
            proc=unreported[0],
            host=plan.host,
            coords={"replica": plan.replica, "rank": plan.procs.index(unreported[0])},
        )
        job.journal.emit(FAILURE, **failure.journal_fields(), t_detected=failure.t_detected)
        job.tracker.on_failure(failure)
    else:
        job.tracker.failed_by_controller(plan.replica, NOT_ADOPTED, time.time())


def release_unclaimed(job: TakenOver) -> None:
    """After the groups were adopted: stop every inherited process that no group claimed (a
    rank of a group the journal no longer names, say), so that nothing runs unsupervised.
    Idle warm spares stay: they went back to their host's pool."""
    stale = job.controller.inherited.unclaimed()
    if stale:
        job.controller.stop_procs(stale, grace_s=0.5, wait=False)
