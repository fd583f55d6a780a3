"""A ``[program]`` job across a controller's takeover (``harness.job.program.takeover``): which
jobs are taken over, the durable program state, binding the tap's port again, the last step
read from the journal, the retries a program gets, and an adopted group's first request."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.config import load_config
from harness.job.program import takeover as pt
from harness.job.program.env import launcher_env, program_quorum_retries
from harness.job.program.groups import ProgramGroups
from harness.job.takeover import TakeoverRefused, supported
from harness.quorum.tap import Request
from runtime.journal import (
    CONTROLLER_TAKEOVER,
    FAILURE,
    GROUP_START,
    HEALED,
    STEP_ABORT,
    STEP_COMMIT,
)

PROGRAM = ["python", "tests/programs/train_ddp.py", "40"]


def cfg(*overrides: str):
    return load_config(
        "experiments/tiny.toml",
        [f"program.command={json.dumps(PROGRAM)}", "recovery.quorum=tree", *overrides],
    )


def test_a_torchft_program_on_the_local_launcher_is_taken_over_and_nothing_else():
    assert supported(cfg()) is None
    assert supported(cfg("ranks=2")) is None  # its store is its host agent's
    why = supported(cfg("program.kind=torchtitan"))
    assert why is not None and "torchtitan" in why
    assert supported(cfg("launcher=slurm")) is None  # through its agents' relays
    why = supported(cfg("launcher=netns"))
    assert why is not None and 'launcher = "netns"' in why
    # the general reasons still hold for programs
    assert "full_restart" in (supported(cfg("recovery.policy=full_restart")) or "")
    assert "tree quorum" in (supported(cfg("recovery.quorum=torchft")) or "")
    assert "grace" in (supported(cfg("recovery.controller_grace_s=0")) or "")


def test_the_program_state_is_saved_whole_and_read_back(tmp_path: Path):
    state = pt.ProgramState(4242, {0: pt.GroupState(0, "127.0.0.1:1"), 2: pt.GroupState(3, "h:2")})
    pt.save(tmp_path, state)
    assert (tmp_path / pt.STATE_FILE).stat().st_mode & 0o777 == 0o600
    assert pt.load(tmp_path) == state


def test_a_missing_or_damaged_program_state_refuses_the_takeover(tmp_path: Path):
    with pytest.raises(TakeoverRefused, match="is missing"):
        pt.load(tmp_path)
    (tmp_path / pt.STATE_FILE).write_text('{"tap_port": 0, "groups": {}}')
    with pytest.raises(TakeoverRefused, match="is not a port"):
        pt.load(tmp_path)
    (tmp_path / pt.STATE_FILE).write_text('{"tap_port": 1, "groups": {"x": {}}}')
    with pytest.raises(TakeoverRefused, match="not a program state"):
        pt.load(tmp_path)
    (tmp_path / pt.STATE_FILE).write_text('{"tap_port": 1')
    with pytest.raises(TakeoverRefused, match="not valid JSON"):
        pt.load(tmp_path)


def test_a_group_s_last_step_is_its_current_incarnation_s_last_commit_or_heal():
    def rec(event: str, replica: int, **kw):
        return {"event": event, "replica": replica, "observed": "quorum", **kw}

    records = [
        rec(GROUP_START, 0),
        rec(STEP_COMMIT, 0, step=5),
        rec(GROUP_START, 1),
        rec(STEP_COMMIT, 1, step=20, sync_every=10),
        rec(STEP_ABORT, 1, step=30, sync_every=10),  # an abort is no step reached
        rec(GROUP_START, 0),  # group 0 restarted: its old steps are not its replacement's
        rec(HEALED, 0, step=4),
        rec(STEP_COMMIT, 0, step=4),
        {"event": STEP_COMMIT, "replica": 2, "step": 9},  # the built-in trainer's: not a tap's
    ]
    assert pt.last_step(records, 0) == 4
    assert pt.last_step(records, 1) == 2  # Manager steps: 20 inner steps / sync_every 10
    assert pt.last_step(records, 2) is None
    assert pt.last_step(records[:6], 0) is None  # restarted, not asked since


def test_a_program_that_can_be_taken_over_retries_its_quorum_requests():
    c = cfg()
    env = launcher_env(c, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2")
    assert "TORCHFT_QUORUM_RETRIES" not in env
    env = launcher_env(
        c, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2", survivable=True
    )
    retries = int(env["TORCHFT_QUORUM_RETRIES"])
    assert retries == program_quorum_retries(c)
    # torchft sleeps quorum_timeout / (retries + 1) between tries: about a quarter second
    quorum_timeout = int(env["TORCHFT_QUORUM_TIMEOUT_SEC"])
    assert 0.2 <= quorum_timeout / (retries + 1) <= 0.26
    mine = cfg('program.env={TORCHFT_QUORUM_RETRIES = "3"}')
    env = launcher_env(
        mine, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2", survivable=True
    )
    assert env["TORCHFT_QUORUM_RETRIES"] == "3"  # program.env has the last word


class _Journal:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.records.append((event, fields))


def test_an_adopted_group_s_repeated_request_is_no_abort_and_its_steps_go_on(tmp_path: Path):
    job = SimpleNamespace(
        cfg=cfg("steps=40"), journal=_Journal(), say=lambda s: None, finished=lambda: None,
        run_dir=tmp_path, survivable=False, plan=None,
    )  # fmt: skip
    groups = ProgramGroups(job)
    rec = SimpleNamespace(
        host=SimpleNamespace(name="h0"), finished=cf.Future(), ref=SimpleNamespace(proc_id="p0")
    )
    training = groups.readmit(0, 3, "127.0.0.1:1000", [rec], "T0", last_step=7)
    g = groups._groups[0]
    assert (g.incarnation, g.member_id, g.last_step, g.resumed) == (3, "T0", 7, True)
    assert groups._by_store["127.0.0.1:1000"] is g
    g.ids.add("m:u")
    for step in (7, 8, 8):  # asked again at 7 (its dead controller saw it), then on
        groups.asked(Request(0, "m:u", step, 0, 1.0))
    got = [(e, f["step"]) for e, f in job.journal.records]
    assert got == [(STEP_COMMIT, 8), (STEP_ABORT, 9)]  # the repeat at 8 is an abort as ever
    rec.finished.set_result(1.0)  # its program exits 0: the group is done
    assert training.done()


class _Controller:
    def __init__(self, procs: dict) -> None:
        self.procs = procs
        self.stopped: list[str] = []
        self.adopted: list[str] = []

    def stop_procs(self, ids: list[str], grace_s: float) -> None:
        self.stopped += ids

    def adopt(self, ids: list[str]) -> None:
        self.adopted += ids


def _takeover_job(tmp_path: Path, procs: dict, admitted: int):

    from harness.quorum import durable
    from runtime.states import ProcState

    durable.save(
        tmp_path / "quorum.json",
        durable.QuorumSnapshot(
            host="127.0.0.1", port=1, secret=b"s" * 32, incarnations={0: admitted},
            fenced=frozenset(), quorum_id_lease=100, last_quorum=(), highest_step=0,
            reported={},
        ),
    )  # fmt: skip
    adopted: list[tuple] = []

    def readmit(*args: object) -> cf.Future:
        adopted.append(args)
        return cf.Future()

    program = SimpleNamespace(
        durable=pt.ProgramState(1, {0: pt.GroupState(2, "127.0.0.1:9")}), readmit=readmit
    )
    running = {
        p: SimpleNamespace(program=True, state=ProcState.RUNNING, ref=SimpleNamespace(proc_id=p))
        for p in procs
    }
    job = SimpleNamespace(
        controller=_Controller(running), program=program, ranks=1, run_dir=tmp_path,
        journal=_Journal(), plan=SimpleNamespace(records=[]), groups={},
        tracker=SimpleNamespace(failures=[], opened=[]),
    )  # fmt: skip
    job.adopted = lambda group: job.groups.__setitem__(group.replica, group)
    job.tracker.on_failure = job.tracker.failures.append
    job.tracker.failed_by_controller = lambda *a: job.tracker.opened.append(a[:2])
    return job, adopted


def test_a_running_program_group_is_adopted_and_one_that_cannot_be_is_stopped(tmp_path: Path):
    from harness.job.takeover import GroupPlan

    plan = GroupPlan(replica=0, incarnation=2, host="h0", procs=("h0/p1",))
    job, adopted = _takeover_job(tmp_path, {"h0/p1": 1}, admitted=2)
    mesh = pt.adopt(job, job.program, plan)
    assert mesh is not None and mesh.proc_ids == ["h0/p1"] and job.controller.adopted == ["h0/p1"]
    ((replica, inc, store, _, member, step),) = adopted
    assert (replica, inc, store, step) == (0, 2, "127.0.0.1:9", None)
    assert member.startswith("replica_0.2.") and job.groups[0].incarnation == 2

    job, adopted = _takeover_job(tmp_path, {}, admitted=2)  # no agent reported its program
    assert pt.adopt(job, job.program, plan) is None and not adopted
    (fields,) = [f for e, f in job.journal.records if e == CONTROLLER_TAKEOVER]
    assert fields["adopted"] is False and "a rank of the group is gone" in fields["reason"]
    # its host was lost with the controller: a failure of its own, so its restart is a recovery
    (failure,) = job.tracker.failures
    assert failure.cause.value == "lost_host" and failure.coords == {"replica": 0, "rank": 0}
    (lost,) = [f for e, f in job.journal.records if e == FAILURE]
    assert lost["cause"] == "lost_host" and lost["host"] == "h0" and lost["replica"] == 0

    job, adopted = _takeover_job(tmp_path, {"h0/p1": 1}, admitted=3)  # a later one admitted
    assert pt.adopt(job, job.program, plan) is None and not adopted
    assert job.controller.stopped == ["h0/p1"]
    assert "admitted a later incarnation" in job.journal.records[-1][1]["reason"]
    # its program ran: stopped here, and its restart is a recovery of its own
    assert job.tracker.failures == [] and job.tracker.opened == [(0, "not_adopted")]
