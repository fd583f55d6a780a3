"""Semi-synchronous programs (``program.sync_every``): the config's checks, the pure rules that
name a wrong ``sync_every``, and the journal in inner steps (the Manager's step x sync_every)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from types import SimpleNamespace

import pytest

from harness.config import ConfigError, load_config
from harness.job.program.groups import ProgramGroups
from harness.job.program.progress import ended_early, gap_warning, hung_detail, past_last_step
from harness.quorum.tap import Request
from runtime.journal import HEALED, STEP_ABORT, STEP_COMMIT

PROGRAM = ["python", "tests/programs/train_diloco.py", "40", "10"]


def cfg(*overrides: str):
    return load_config(
        "experiments/tiny.toml", [f"program.command={json.dumps(PROGRAM)}", *overrides]
    )


def test_sync_every_is_checked_when_the_config_is_built():
    c = cfg("steps=40", "program.sync_every=10")
    assert c.program.sync_every == c.program.steps_per_quorum == 10
    assert cfg("steps=40").program.steps_per_quorum == 1  # unset: a quorum every step
    with pytest.raises(ConfigError, match=r"program.sync_every = 0: must be a whole number"):
        cfg("program.sync_every=0")
    with pytest.raises(ConfigError, match=r"steps = 45 is not a multiple of program.sync_every"):
        cfg("steps=45", "program.sync_every=10")
    # the built-in trainer: the key does nothing (its journal counts its own steps)
    builtin = load_config("experiments/tiny.toml", ["program.sync_every=7"])
    assert builtin.program.steps_per_quorum == 1


def test_a_group_that_ends_early_is_named_with_the_sync_every_that_fits():
    assert ended_early(last_step=39, steps=40, sync_every=1) is None  # finished
    assert ended_early(last_step=3, steps=40, sync_every=10) is None  # 4 syncs x 10
    why = ended_early(last_step=3, steps=40, sync_every=1)
    assert why is not None and "after 4 quorum steps" in why and "last step 40" in why
    assert "set program.sync_every = 10" in why
    why = ended_early(last_step=2, steps=40, sync_every=1)  # 3 syncs: nothing divides
    assert why is not None and "set program.sync_every" not in why
    why = ended_early(last_step=None, steps=40, sync_every=1)
    assert why is not None and "without ever asking for a quorum" in why


def test_a_step_past_the_last_and_a_gap_near_the_progress_timeout_say_what_to_change():
    assert past_last_step(21, 20, 1) == "asked for step 21, past the job's last step 20"
    why = past_last_step(3, 40, 20)
    assert "inner step 60 with program.sync_every = 20" in why and "lower" in why
    assert gap_warning(2.0, 10.0, 10) is None
    warn = gap_warning(6.0, 10.0, 10)
    assert warn is not None and "once per 10 inner steps" in warn
    assert "never asked" in hung_detail(0, 91.0, asked=False, sync_every=1)
    assert "program.sync_every = 10" in hung_detail(0, 9.0, asked=True, sync_every=10)
    assert "sync_every" not in hung_detail(0, 9.0, asked=True, sync_every=1)


class _Journal:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.records.append((event, fields))

    def add_sink(self, sink) -> None:  # RecoveryTracker's: not needed here
        pass


def _one_group(*overrides: str):
    """A stand-in job (its journal, what it says) and ProgramGroups with replica group 0
    registered, its Manager "m:u" admitted."""
    said: list[str] = []
    job = SimpleNamespace(
        survivable=False,
        plan=None,
        cfg=cfg(*overrides),
        journal=_Journal(),
        say=said.append,
        finished=lambda: None,
    )
    groups = ProgramGroups(job)
    rec = SimpleNamespace(host=SimpleNamespace(name="h0"), finished=cf.Future())
    g = groups._register(0, 0, "127.0.0.1:1000", [rec], "T0")
    g.ids.add("m:u")
    return job, said, groups, g


def test_the_tap_s_view_is_journaled_in_inner_steps():
    """Manager steps 0, 1, 1, 4, 5 of a program that syncs every 10 inner steps: commits at
    inner steps 10 and 40 and 50, an abort of the sync ending at 20, a heal to 40; a request
    past the job's last step ends the group with a message naming sync_every."""
    job, said, groups, g = _one_group("steps=40", "program.sync_every=10")
    for step in (0, 1, 1, 4, 5):
        groups.asked(Request(0, "m:u", step, 0, 1.0))
    got = [(e, f["step"]) for e, f in job.journal.records]
    assert got == [
        (STEP_COMMIT, 10),
        (STEP_ABORT, 20),
        (HEALED, 40),
        (STEP_COMMIT, 40),
        (STEP_COMMIT, 50),
    ]
    assert all(f["sync_every"] == 10 for _, f in job.journal.records)
    abort = job.journal.records[1][1]
    assert "the 10 inner steps since its last sync are discarded" in abort["reason"]
    assert g.training.done() and any("inner step 50" in s for s in said), said


def test_bench_recovery_program_rows_kill_ten_times_with_torchft_s_default_timeout(tmp_path):
    from argparse import Namespace

    from experiments.bench.recovery import PROGRAM_CONFIGS, _syncs_match, program_reps

    assert program_reps(Namespace(reps=None, quick=True)) == 10
    assert program_reps(Namespace(reps=4, quick=True)) == 4
    for name, overrides in PROGRAM_CONFIGS.items():
        command = json.loads(next(o for o in overrides if o.startswith("program.command="))[16:])
        assert command[-2:] == ["0", "60"], name  # no extra step time; a 60 s gloo timeout
    assert {"program_diloco/tree", "program_localsgd/torchft"} <= set(PROGRAM_CONFIGS)
    (tmp_path / "replica0-rank0.log").write_text("sync 1 checksum aa\nsync 2 checksum bb\n")
    (tmp_path / "replica1-rank0.log").write_text("x\nsync 2 checksum bb\nsync 3 checksum cc\n")
    assert _syncs_match(tmp_path) is True
    (tmp_path / "replica2-rank0.log").write_text("sync 3 checksum dd\n")
    assert _syncs_match(tmp_path) is False


def test_requests_close_to_the_progress_timeout_twice_in_a_row_are_told_once():
    import time

    job, said, groups, g = _one_group("steps=400", "program.sync_every=10")
    slow = job.cfg.program.progress_timeout_s * 0.6
    for step, gap in enumerate((0.0, slow, 0.0, slow, slow, slow, slow)):
        if g.last is not None:
            g.last = time.monotonic() - gap
        groups.asked(Request(0, "m:u", step, 0, 1.0))
    warned = [s for s in said if "leaves less than twice that" in s]
    assert len(warned) == 1 and "once per 10 inner steps" in warned[0], said


def test_steps_lost_counts_a_sync_done_again_as_its_inner_steps():
    from dashboards.metrics import steps_lost

    def commit(t: float, step: int, replica: int, **kw) -> dict:
        return {"event": STEP_COMMIT, "t": t, "step": step, "replica": replica, "rank": 0, **kw}

    # group 1 committed inner step 110 just before it was killed; the survivor commits 110 again
    ddp = [commit(1.0, 110, 0), commit(1.1, 110, 1), commit(2.0, 110, 0), commit(3.0, 120, 0)]
    assert steps_lost(ddp, fault_t=1.5, next_fault_t=None) == 1
    semi = [dict(r, sync_every=10) for r in ddp]
    assert steps_lost(semi, fault_t=1.5, next_fault_t=None) == 10
    assert steps_lost(semi[:2] + semi[3:], fault_t=1.5, next_fault_t=None) == 0


def test_a_group_that_fails_after_every_other_finished_the_last_step_ends_the_job():
    """Its replacement would have no peer to heal from (torchft's Lighthouse: it trains alone
    from step 0; the tree quorum: it waits for a step no live member holds): the job is done.
    Not while another group still trains, nor when the others all stopped short of the last
    step, nor for a rank of an old incarnation."""
    from runtime.failure import Cause, Failure

    ended: list[bool] = []
    said: list[str] = []
    job = SimpleNamespace(
        survivable=False,
        plan=None,
        cfg=cfg("replicas=3", "steps=100"),
        journal=_Journal(),
        say=said.append,
        finished=lambda: ended.append(True),
    )
    groups = ProgramGroups(job)
    recs = {}
    for r in range(3):
        recs[r] = SimpleNamespace(
            host=SimpleNamespace(name="h0"),
            finished=cf.Future(),
            ref=SimpleNamespace(proc_id=f"p{r}"),
        )
        groups._register(r, 0, f"127.0.0.1:{1000 + r}", [recs[r]], f"T{r}")

    def fail(replica: int, proc: str) -> None:
        groups._after_the_others(
            Failure(cause=Cause.SIGNAL, detail="killed", proc=proc, coords={"replica": replica})
        )

    def finish(replica: int, last_step: int) -> None:
        g = groups._groups[replica]
        g.last_step = last_step
        g.training.set_result(None)

    finish(1, 99)  # asked for step 99, then committed step 100: the last one
    fail(0, "p0")  # group 2 still trains
    assert not ended
    finish(2, 40)  # exited early
    fail(0, "p-old")  # not a rank of group 0's current incarnation
    assert not ended
    fail(0, "p0")
    assert ended == [True] and any("replica group 0 failed after every other" in s for s in said)

    ended.clear()
    groups._groups[1].last_step = 40  # had no group reached the last step, the job goes on
    fail(0, "p0")
    assert not ended


def test_a_group_still_rejoining_when_the_others_finish_the_last_step_is_overtaken():
    """Group 0 failed at step 86 of 100; the survivors finished before its replacement could
    rejoin: its recovery ends ``overtaken`` and the job ends at once (not after the replacement
    waits out the quorum's timeout). Not while a group that did not fail still trains."""
    from harness.job.recovery import RecoveryTracker
    from runtime.failure import Cause, Failure
    from runtime.journal import OVERTAKEN, RECOVERY_PHASE

    ended: list[bool] = []
    said: list[str] = []
    journal = _Journal()
    job = SimpleNamespace(
        survivable=False,
        plan=None,
        cfg=cfg("replicas=3", "steps=100"),
        journal=journal,
        say=said.append,
        finished=lambda: ended.append(True),
        tracker=RecoveryTracker(journal),  # type: ignore[arg-type]
    )
    groups = ProgramGroups(job)
    for r in range(3):
        rec = SimpleNamespace(host=SimpleNamespace(name="h0"), finished=cf.Future())
        groups._register(r, 0, f"127.0.0.1:{1000 + r}", [rec], f"T{r}")
    job.tracker.on_failure(
        Failure(cause=Cause.SIGNAL, detail="killed", proc="p0", coords={"replica": 0})
    )

    def finish(replica: int) -> None:
        g = groups._groups[replica]
        g.last_step = 99
        g.training.set_result(None)
        groups._check_all_done()

    finish(1)
    assert not ended  # group 2 did not fail: it still trains
    finish(2)
    assert ended == [True]
    assert any("replica group 0 was still rejoining" in s for s in said), said
    phases = [f["phase"] for e, f in journal.records if e == RECOVERY_PHASE]
    assert phases == ["detected", OVERTAKEN]
    assert job.tracker.open_replicas() == set() and job.tracker.stateless_replicas() == set()
