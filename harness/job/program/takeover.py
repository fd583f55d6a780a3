"""A ``[program]`` job's groups across a controller's death (``harness.job.takeover``,
``docs/controller.md``): what a new controller needs to go on serving the programs a dead one
started, without restarting them.

A program is the user's own, unmodified: it was given its quorum service's address
(``TORCHFT_LIGHTHOUSE``: the controller's quorum tap, ``harness.quorum.tap``) and its group's
store (``MASTER_ADDR``/``MASTER_PORT``) once, in its environment, and keeps them for life. So:

* **The tap comes back behind the same address.** Programs were given their host agent's quorum
  relay (``runtime.relay``), whose address never changes: a new controller serves its tap on a
  fresh port and points every relay at it (never its predecessor's port, which anyone on the
  machine may have taken meanwhile: issue #49).
* **A quorum request waits.** The programs of a job that can be taken over get
  ``TORCHFT_QUORUM_RETRIES`` (``harness.job.program.env.program_quorum_retries``): a request
  in flight when the controller died, or made while none serves, fails and is asked again
  every ~0.25 s until the new tap answers.
* **The tap admits the adopted groups again.** ``program.json`` also keeps each group's
  current incarnation and store address (a quorum request names its group by it:
  ``harness.job.program.admission``); the processes, their pids and rank 0's host agent come
  from the agents' reports (``runtime.takeover.Inheritance``); the tagged member id the quorum
  service admitted, from ``quorum.json`` (``harness.quorum.durable``); the group's last step,
  from the journal (:func:`last_step`).
* **The group store.** It is served on the group's host by its agent
  (``runtime.group_store``), not by the controller, so it outlives the controller as the ranks
  do: a program that builds its own process group on it (``torch.distributed``'s ``env://``)
  or whose ranks meet there after they started is served by it across a takeover.
  torchtitan's programs are still refused (``harness.job.takeover.supported``): torchtitan
  does not train on a CPU-only machine, so no takeover of one has been tested.

Not covered: a program that exited (code 0) while no controller served is not in its agent's
report, so its group is restarted in place like a group that lost a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from harness.job.takeover import GroupPlan, TakenOver, TakeoverRefused, not_adopted
from runtime.journal import CONTROLLER_TAKEOVER, GROUP_START, HEALED, STEP_COMMIT

if TYPE_CHECKING:
    import concurrent.futures as cf

    from runtime.mesh import ProcMesh

#: The file in the run directory (mode 0600, like every control file of a run).
STATE_FILE = "program.json"


@dataclass(frozen=True)
class GroupState:
    """A group's current incarnation and its store's ``host:port``, as its programs got it."""

    incarnation: int
    store: str


@dataclass
class ProgramState:
    """``RUN/program.json``: the quorum tap's port and each group's current incarnation."""

    tap_port: int
    groups: dict[int, GroupState]

    def to_json(self) -> dict[str, Any]:
        return {
            "tap_port": self.tap_port,
            "groups": {
                str(r): {"incarnation": g.incarnation, "store": g.store}
                for r, g in sorted(self.groups.items())
            },
        }


def decode(doc: Mapping[str, Any], where: str = STATE_FILE) -> ProgramState:
    """``doc`` (``program.json``'s object) as a ProgramState; ValueError naming what is wrong."""
    try:
        port = doc["tap_port"]
        groups = {
            int(r): GroupState(int(g["incarnation"]), str(g["store"]))
            for r, g in dict(doc["groups"]).items()
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a program state ({type(exc).__name__}: {exc})") from None
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{where}: tap_port {port!r} is not a port")
    return ProgramState(port, groups)


def save(run_dir: Path, state: ProgramState) -> None:
    """Write ``RUN/program.json`` whole and durably (a reader sees the old file or the new)."""
    from harness.rundir import write_json_atomic

    write_json_atomic(Path(run_dir) / STATE_FILE, state.to_json())


def load(run_dir: Path) -> ProgramState:
    """``RUN/program.json``; TakeoverRefused if it is missing or damaged."""
    from harness.rundir import read_json

    path = Path(run_dir) / STATE_FILE
    try:
        doc = read_json(path)
        if doc is None:
            raise ValueError(f"{path} is missing: its controller kept no program state")
        return decode(doc, str(path))
    except ValueError as exc:
        raise TakeoverRefused(f"the programs cannot be taken over: {exc}") from None


def open_tap(
    make: Callable[[int], Any], run_dir: Path, *, takeover: bool, survivable: bool
) -> tuple[Any, ProgramState | None]:
    """The job's quorum tap (``make(port)``) and its durable state (its predecessor's after a
    takeover). Always on a fresh port: programs reach the tap through their agents' relays,
    which the job points at it, so a takeover never binds its predecessor's port again (anyone
    on the machine may have taken it meanwhile). A ``survivable`` job's state is saved before
    any program is given the tap's address."""
    durable = load(run_dir) if takeover else None
    tap = make(0)
    if survivable:
        durable = durable or ProgramState(tap.port, {})
        durable.tap_port = tap.port
        save(run_dir, durable)
    return tap, durable


def last_step(records: Iterable[Mapping[str, Any]], replica: int) -> int | None:
    """The last quorum step (the Manager's, not inner steps: a record's ``step`` divided by its
    ``sync_every``) the journal says group ``replica``'s current incarnation reached (its tap
    journals a commit, or a heal, when it sees a request at a higher step); None if none since
    the group's last start."""
    step: int | None = None
    for r in records:
        if r.get("replica") != replica:
            continue
        if r["event"] == GROUP_START:
            step = None
        elif r["event"] in (STEP_COMMIT, HEALED) and r.get("observed") == "quorum":
            s = int(r.get("step", 0)) // max(1, int(r.get("sync_every", 1)))
            step = s if step is None else max(step, s)
    return step


def member_id(run_dir: Path, replica: int, incarnation: int) -> str | None:
    """The tagged id the tree quorum admitted incarnation ``incarnation`` of group ``replica``
    by (``quorum.json``); None if it admitted another (a later one the dead controller did not
    live to journal: the running processes are stale)."""
    from harness.quorum import durable, rule

    snap = durable.load(Path(run_dir) / "quorum.json")
    if snap.incarnations.get(replica) != incarnation:
        return None
    return rule.member_id(snap.secret, replica, incarnation)


class Readmits(Protocol):
    """What adopting a program group needs of the program's groups
    (``harness.job.program.groups.ProgramGroups`` is one)."""

    durable: ProgramState | None

    def readmit(
        self, replica: int, incarnation: int, store: str, recs: list[Any], member_id: str,
        last_step: int | None,
    ) -> cf.Future: ...  # fmt: skip


def adopt(job: TakenOver, program: Readmits, plan: GroupPlan) -> ProcMesh | None:
    """Adopt a program group the journal says runs (``TrainerGroups.adopt``'s part for a
    ``[program]`` job): every rank's program alive, its store and member id known, the group is
    this controller's as it runs (same processes, same incarnation), its tap admissions and its
    last step restored. None if not: the rest of it is stopped here, and the caller restarts the
    group in place."""
    from harness.job.replica_group import ReplicaGroup
    from runtime.mesh import ProcMesh
    from runtime.states import ProcState

    c = job.controller
    recs = [c.procs.get(p) for p in plan.procs]
    state = program.durable.groups.get(plan.replica) if program.durable else None
    why = None
    if len(recs) != job.ranks or not all(
        r is not None and r.program and r.state is ProcState.RUNNING for r in recs
    ):
        why = "a rank of the group is gone"
    elif state is None or state.incarnation != plan.incarnation:
        why = f"{STATE_FILE} does not name incarnation {plan.incarnation}'s store"
    elif (member := member_id(job.run_dir, plan.replica, plan.incarnation)) is None:
        why = "the quorum service admitted a later incarnation"
    if why is not None:
        not_adopted(job, plan, why)
        return None
    live = [r for r in recs if r is not None]
    assert state is not None and member is not None and len(live) == len(recs)
    c.adopt(list(plan.procs))
    mesh = ProcMesh(
        c, {"replica": 1, "rank": len(live)}, {(0, k): r.ref for k, r in enumerate(live)}
    )
    step = last_step(job.plan.records if job.plan is not None else [], plan.replica)
    training = program.readmit(plan.replica, plan.incarnation, state.store, live, member, step)
    group = ReplicaGroup(plan.replica, plan.incarnation, plan.host, mesh, state.store, training)
    job.adopted(group)
    job.journal.emit(
        CONTROLLER_TAKEOVER, replica=plan.replica, adopted=True, procs=list(plan.procs),
        step=step,
    )  # fmt: skip
    return mesh
