"""No silent stall (``harness.job.stall``): the endpoint read from torch's errors, when a run of
aborts is a stall, what the console and the journal say, and the config's ordering rule."""

from __future__ import annotations

import threading
import time

import pytest

from harness.config import ConfigError, load_config
from harness.job.completion import Completion
from harness.job.progress import Progress
from harness.job.stall import JOB_STALL, StallWatch, Streak, endpoint, error_name, judge
from runtime.journal import STEP_ABORT, STEP_COMMIT, Journal


@pytest.mark.parametrize(
    ("reason", "want"),
    [
        (  # torch's socket error, as a step abort journals it
            "DistNetworkError('The client socket has timed out after 2000ms while trying to "
            "connect to (192.0.2.1, 46281).')",
            "192.0.2.1:46281",
        ),
        (
            "DistStoreError('wait timeout after 5000ms, keys: /torchft/3/0 at 10.0.0.2:41234')",
            "10.0.0.2:41234",
        ),
        ("quorum failed: RuntimeError('connect to [::1]:29500 refused')", "[::1]:29500"),
        ("DistNetworkError('failed to connect to (rack1-b, 41234)')", "rack1-b:41234"),
        ("quorum failed: RuntimeError('connecting to http://10.0.0.1:29510/')", "10.0.0.1:29510"),
        ("not enough replicas", None),
        ("RuntimeError('collectives aborted by fault injection')", None),
    ],
)
def test_the_endpoint_an_error_names(reason, want):
    assert endpoint(reason) == want


def test_the_error_an_abort_names():
    assert error_name("DistStoreError('x')") == "DistStoreError"
    assert error_name("quorum failed: TimeoutError()") == "TimeoutError"
    assert error_name("not enough replicas") is None


def _streak(*times: float, gap: float = 5.0) -> Streak:
    s = Streak()
    for t in times:
        s.add(t, gap, "DistNetworkError('... (10.0.0.2, 41234)')", "replica 0", 0)
    return s


def test_a_run_of_aborts_warns_at_half_the_limit_and_stalls_at_it():
    s = _streak(100.0, 102.0, 104.0, 106.0, 108.0, 110.0)
    assert judge(s, 104.0, 10.0).state == "ok"
    assert judge(s, 106.0, 10.0).state == "warn"
    v = judge(s, 110.5, 10.0)
    assert v.state == "stall" and v.stalled_s == pytest.approx(10.5)
    assert s.aborts == 6 and s.endpoints["10.0.0.2:41234"] == 6


def test_a_pause_between_aborts_is_not_a_stall_and_starts_a_new_streak():
    s = _streak(100.0, 101.0)
    assert judge(s, 106.0, 10.0).state == "ok"  # no abort for half the limit: a pause
    s.add(120.0, 5.0, "x", "replica 1", 1)
    assert s.first_t == 120.0 and s.aborts == 1  # counted from the new first abort
    assert judge(s, 124.0, 10.0).state == "ok"


def test_no_progress_must_exceed_twice_the_quorum_and_manager_timeouts():
    with pytest.raises(ConfigError, match=r"timeouts\.no_progress .* timeouts\.quorum_timeout"):
        load_config("experiments/tiny.toml", ["timeouts.no_progress=15"])
    with pytest.raises(ConfigError, match=r"timeouts\.no_progress .* timeouts\.manager_timeout"):
        load_config(
            "experiments/tiny.toml", ["timeouts.no_progress=25", "timeouts.manager_timeout=20"]
        )
    assert load_config("experiments/tiny.toml", []).timeouts.no_progress == 120.0


def test_a_stalled_job_fails_with_the_diagnosis_and_the_console_says_so(tmp_path, capsys):
    """A real watch on a real journal: a commit, then aborts naming one endpoint every 0.1 s."""
    cfg = load_config("experiments/tiny.toml", ["replicas=3", "steps=150"])
    journal = Journal(tmp_path / "journal.jsonl", job="t")
    tracker = type("T", (), {"completed": 0, "open_count": 0})()
    progress = Progress(cfg, tracker, every_s=0.2)
    journal.add_sink(progress.on_record)
    completion = Completion(str(journal.path), lambda: None)
    watch = StallWatch(
        2.0, journal, say=progress.say, fail=completion.fail, tick=progress.tick, poll_s=0.05
    )
    progress.aborts = watch.summary
    watch.start()
    journal.emit(STEP_COMMIT, replica=0, rank=0, step=1, loss=5.0, participants=1)
    stop = threading.Event()

    def abort() -> None:
        while not stop.wait(0.1):
            for replica in (1, 2):
                journal.emit(
                    STEP_ABORT, replica=replica, rank=0, step=2, host="n2",
                    reason="DistStoreError('timed out connecting to 10.0.0.2:41234')",
                )  # fmt: skip

    threading.Thread(target=abort, daemon=True).start()
    t0 = time.monotonic()
    status, reason = completion.wait(timeout=20)
    stop.set()
    watch.close()
    journal.close()
    assert time.monotonic() - t0 < 10
    assert status == "failed"
    assert "no step committed for 2 s" in reason and "failing endpoint 10.0.0.2:41234" in reason
    assert "replica groups 1, 2" in reason and "DistStoreError" in reason
    err = capsys.readouterr().err
    assert "step 1/150 | loss 5.000 | groups 1/3 | " in err
    assert "aborted (last: DistStoreError 10.0.0.2:41234: timed out connecting to" in err
    assert "warning: no step committed for 1 s while groups keep aborting" in err
    assert f"[ftharness] stalled: {reason}" in err
    from runtime.journal import read_journal

    stalls = [r for r in read_journal(tmp_path / "journal.jsonl") if r["event"] == JOB_STALL]
    assert len(stalls) == 1 and stalls[0]["endpoint"] == "10.0.0.2:41234"
    assert stalls[0]["replicas"] == [1, 2] and stalls[0]["aborts"] >= 10
    assert stalls[0]["error_type"] == "DistStoreError"


def test_a_commit_clears_the_aborts_from_the_progress_line(tmp_path):
    journal = Journal(None, job="t")
    watch = StallWatch(10.0, journal, say=lambda _: None, fail=lambda _: None)
    journal.emit(STEP_ABORT, replica=0, rank=0, step=2, reason="RuntimeError('x')")
    journal.emit(STEP_ABORT, replica=0, rank=1, step=2, reason="RuntimeError('x')")  # a group's
    assert watch.summary() == "1 aborted (last: RuntimeError: x)"
    journal.emit(STEP_COMMIT, replica=0, rank=0, step=2)
    assert watch.summary() is None
