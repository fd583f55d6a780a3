"""``settle_s``: a chaos run ends once its faults are over (every planned fault fired and healed,
every recovery closed, then ``settle_s`` of quiet), well, with a reason that says so; a value that
does not outlast the job's failure detection is refused before anything launches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from experiments import chaos_job
from experiments.chaos_job import end_when_settled
from experiments.spec import ExperimentError, load_experiment
from harness.job.completion import Completion

EXPERIMENT = """\
name = "t"
duration_s = 60
{settle}

[job]
replicas = 2
timeouts = {{ heartbeat_timeout = 1.0, host_timeout = 3.0 }}

[schedule]
kind = "at_times"
at_times = [2]

[faults]
mix = {{ kill = 1 }}
"""


def _spec(tmp_path: Path, settle: str):
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT.format(settle=settle))
    return load_experiment(path)


def test_settle_s_is_read_and_is_optional(tmp_path: Path) -> None:
    assert _spec(tmp_path, "settle_s = 4").settle_s == 4.0
    assert _spec(tmp_path, "").settle_s is None


@pytest.mark.parametrize("value", ["3", "0.5", "-1", '"soon"'])
def test_a_settle_s_within_failure_detection_is_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ExperimentError, match="settle_s"):
        _spec(tmp_path, f"settle_s = {value}")


def test_completion_end_is_a_good_ending_with_its_reason() -> None:
    completion = Completion("journal.jsonl", lambda: None)
    threading.Timer(0.1, completion.end, ("its faults are over",)).start()
    assert completion.wait(timeout=5) == ("ok", "its faults are over")


class _Injector:
    def __init__(self) -> None:
        self.done = False


class _Tracker:
    open_count = 0


class _Job:
    def __init__(self) -> None:
        self.tracker = _Tracker()
        self.ended = threading.Event()
        self.reason = ""

    def end(self, reason: str) -> None:
        self.reason = reason
        self.ended.set()


@pytest.fixture
def fast_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chaos_job, "SETTLE_POLL_S", 0.01)


@pytest.mark.usefixtures("fast_poll")
def test_the_run_ends_only_after_faults_and_recoveries_are_over_and_quiet() -> None:
    job, injector = _Job(), _Injector()
    stop = end_when_settled(job, injector, settle_s=0.3)
    try:
        assert not job.ended.wait(0.5)  # a fault still to fire (or to heal)
        injector.done = True
        job.tracker.open_count = 1  # the failure it caused is still recovering
        assert not job.ended.wait(0.5)
        job.tracker.open_count = 0
        t0 = time.monotonic()
        assert job.ended.wait(5)
        assert time.monotonic() - t0 >= 0.3  # quiet for settle_s first
        assert "settle_s" in job.reason and "0.3 s" in job.reason
    finally:
        stop.set()


@pytest.mark.usefixtures("fast_poll")
def test_a_recovery_that_opens_while_settling_starts_the_quiet_over() -> None:
    job, injector = _Job(), _Injector()
    injector.done = True
    stop = end_when_settled(job, injector, settle_s=0.4)
    try:
        time.sleep(0.25)
        job.tracker.open_count = 1  # a failure seen late (the last fault's)
        time.sleep(0.3)
        assert not job.ended.is_set()
        job.tracker.open_count = 0
        t0 = time.monotonic()
        assert job.ended.wait(5)
        assert time.monotonic() - t0 >= 0.4
    finally:
        stop.set()


@pytest.mark.usefixtures("fast_poll")
def test_stopping_the_watch_never_ends_the_job() -> None:
    job, injector = _Job(), _Injector()
    injector.done = True
    end_when_settled(job, injector, settle_s=0.2).set()
    assert not job.ended.wait(0.5)


def test_with_controller_crashes_settle_s_outlasts_the_controllers_silence(tmp_path: Path) -> None:
    """A wedged controller is seen by its silence: a shorter settle_s could end the run there."""
    path = tmp_path / "exp.toml"
    text = EXPERIMENT.format(settle="settle_s = 5").replace("kill = 1", "controller_crash = 1")
    path.write_text(text)
    with pytest.raises(ExperimentError, match="controller_silence"):
        load_experiment(path)
    path.write_text(text.replace("settle_s = 5", "settle_s = 11"))
    assert load_experiment(path).settle_s == 11.0
