"""A survivor that asks for no quorum after another group's death is failed once it is past its
grace (harness.job.program.progress.blocked_survivor); nothing else is."""

from __future__ import annotations

from harness.job.program.progress import blocked_survivor, survivor_grace
from harness.program_config import ProgramConfig

SURVIVOR_GRACE_S = ProgramConfig().survivor_grace_s  # the default, 2 s

PACE = [0.03, 0.02, 0.04]  # three gaps between requests: its pace is known


def _blocked(**kw):
    args = dict(
        replica=1,
        survived=(0, 100.0),
        last_step=30,
        gaps=PACE,
        last=99.99,
        waiting=0,
        now=100.0 + SURVIVOR_GRACE_S + 0.1,
        steps=300,
        sync_every=1,
        floor_s=SURVIVOR_GRACE_S,
    )
    args.update(kw)
    return blocked_survivor(**args)


def test_a_silent_survivor_past_its_grace_is_blocked_and_the_detail_says_why():
    silent, detail = _blocked()
    assert abs(silent - (SURVIVOR_GRACE_S + 0.1)) < 1e-9
    assert "replica group 1 asked for no quorum for 2.1 s after replica group 0 died" in detail
    assert "within 2.0 s" in detail


def test_within_its_grace_or_answered_since_it_is_not():
    assert _blocked(now=100.0 + SURVIVOR_GRACE_S - 0.1) is None
    # the quorum service answered it after the death: the grace counts from the answer
    assert _blocked(last=101.0) is None


def test_a_request_in_flight_an_unknown_pace_or_no_death_is_never_blocked():
    assert _blocked(waiting=1) is None
    assert _blocked(gaps=PACE[:2]) is None  # just started or healed
    assert _blocked(survived=None) is None
    assert _blocked(last_step=None) is None


def test_near_the_jobs_last_step_a_group_may_exit_without_asking():
    assert _blocked(last_step=298) is None
    assert _blocked(last_step=297) is not None
    # semi-synchronous: steps are inner steps, a request once per sync
    assert _blocked(last_step=28, sync_every=10) is None
    assert _blocked(last_step=27, sync_every=10) is not None


def test_the_grace_is_three_of_the_groups_own_gaps_when_that_is_longer():
    assert survivor_grace([0.01, 0.02, 0.03], 2.0) == 2.0
    assert survivor_grace([1.0, 5.0, 2.0, 2.0], 2.0) == 6.0  # 3 x the median
    assert survivor_grace([1.0, 1.0], 2.0) is None
    slow = [2.0, 2.0, 2.0]
    assert _blocked(gaps=slow, now=100.0 + 5.9) is None
    assert _blocked(gaps=slow, now=100.0 + 6.1) is not None


def test_program_survivor_grace_s_sets_the_floor_and_zero_turns_it_off():
    assert _blocked(floor_s=5.0, now=100.0 + 4.9) is None
    assert _blocked(floor_s=5.0, now=100.0 + 5.1) is not None
    assert _blocked(floor_s=0.0, now=100.0 + 1000.0) is None
